// floor: the least an in-pod HBONE proxy can do, to measure what any proxy
// in Ambit's or ztunnel's place could reach on this kernel with these rules.
//
// It makes the same TCP connections as a dedicated ambient proxy (the
// application's to the proxy through the in-pod REDIRECT, proxy to proxy
// on port 15008, proxy to the application with the client's address as
// source) and seals every byte between the proxies with AES-256-GCM in
// records of up to 16 KiB (the cipher rustls negotiates first), each
// record's tag checked on the way in. It does nothing else: no TLS
// handshake (one fixed key), no certificates, no HTTP/2, no pooling (one
// proxy-to-proxy connection per application connection), no policy, no
// metrics. A destination outside the mesh is relayed with splice(2), as
// Ambit's passthrough is. Blocking sockets, two threads per connection
// (one per direction): no event loop between a read and its write.
//
// It is not a proxy to run: the key is a constant and anyone who can reach
// port 15008 is served. It stands in for a proxy in `cargo bench --bench
// dataplane` (`AMBIT_BENCH_PEER=/path/to/floor`), started the way the lab
// starts a proxy:
//
//   floor proxy        (LOCAL_XDS_PATH names the lab's mesh.yaml: the
//                       addresses in its workloadIps lines are meshed)
//
// It answers any request on 127.0.0.1:15021 with 200 once it listens.
// Build: cc -O2 -o floor floor.c -lcrypto -lpthread (libssl-dev).
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter_ipv4.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/evp.h>

#define MARK 0x539
#define RECORD (16 * 1024)
#define TAG 16
#define HEAD 4
#define READ_AT_ONCE (256 * 1024)
#define MAX_MESHED 256

static const unsigned char KEY[32] = "ambit-floor-proxy-bench-only-key";

static struct in_addr meshed[MAX_MESHED];
static int n_meshed;

static void die(const char *what)
{
	perror(what);
	exit(1);
}

// The addresses of the mesh's workloads, from the lab's local config: every
// quoted IPv4 address on a line that says workloadIps.
static void read_mesh(const char *path)
{
	FILE *f = fopen(path, "r");
	if (!f)
		die("LOCAL_XDS_PATH");
	char line[4096];
	while (fgets(line, sizeof line, f)) {
		char *p = strstr(line, "workloadIps");
		while (p && (p = strchr(p, '"'))) {
			char *end = strchr(p + 1, '"');
			if (!end)
				break;
			*end = 0;
			if (n_meshed < MAX_MESHED &&
			    inet_pton(AF_INET, p + 1, &meshed[n_meshed]) == 1)
				n_meshed++;
			p = end + 1;
		}
	}
	fclose(f);
}

static int is_meshed(struct in_addr a)
{
	for (int i = 0; i < n_meshed; i++)
		if (meshed[i].s_addr == a.s_addr)
			return 1;
	return 0;
}

static void tune(int fd)
{
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// A socket of the proxy's own: marked, so the in-pod rules let it by.
// With `src`, it connects from that address (the client's), as an ambient
// proxy delivers to its application.
static int dial(struct sockaddr_in to, const struct in_addr *src)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0)
		return -1;
	int mark = MARK, one = 1;
	setsockopt(fd, SOL_SOCKET, SO_MARK, &mark, sizeof mark);
	if (src) {
		struct sockaddr_in from = {.sin_family = AF_INET, .sin_addr = *src};
		setsockopt(fd, SOL_IP, IP_TRANSPARENT, &one, sizeof one);
		setsockopt(fd, SOL_IP, IP_FREEBIND, &one, sizeof one);
		if (bind(fd, (struct sockaddr *)&from, sizeof from) < 0) {
			close(fd);
			return -1;
		}
	}
	tune(fd);
	if (connect(fd, (struct sockaddr *)&to, sizeof to) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

static int send_all(int fd, const unsigned char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

static int recv_all(int fd, unsigned char *p, size_t n)
{
	while (n > 0) {
		ssize_t r = recv(fd, p, n, 0);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		p += r;
		n -= (size_t)r;
	}
	return 0;
}

// One direction of one connection. `seal`: plaintext from `from` is sealed
// into records to `to`; otherwise records from `from` are opened to `to`.
// `dir` keeps the two directions' nonces apart.
struct leg {
	int from, to;
	int seal;
	unsigned char dir;
};

static void nonce(unsigned char iv[12], unsigned char dir, uint64_t n)
{
	memset(iv, 0, 12);
	iv[0] = dir;
	for (int i = 0; i < 8; i++)
		iv[11 - i] = (unsigned char)(n >> (8 * i));
}

// Each leg returns 0 when `from` ended cleanly, -1 when it failed.
static int seal_leg(struct leg *l, EVP_CIPHER_CTX *c)
{
	unsigned char *in = malloc(READ_AT_ONCE);
	unsigned char *out = malloc(READ_AT_ONCE + (READ_AT_ONCE / RECORD + 1) * (HEAD + TAG));
	uint64_t seq = 0;
	int ended = -1;
	for (; in && out;) {
		ssize_t n = recv(l->from, in, READ_AT_ONCE, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			ended = n == 0 ? 0 : -1;
			break;
		}
		size_t o = 0;
		for (ssize_t at = 0; at < n; at += RECORD) {
			int len = (int)(n - at < RECORD ? n - at : RECORD), got;
			unsigned char iv[12];
			nonce(iv, l->dir, seq++);
			out[o] = (unsigned char)(len >> 24);
			out[o + 1] = (unsigned char)(len >> 16);
			out[o + 2] = (unsigned char)(len >> 8);
			out[o + 3] = (unsigned char)len;
			o += HEAD;
			EVP_EncryptInit_ex(c, NULL, NULL, NULL, iv);
			EVP_EncryptUpdate(c, out + o, &got, in + at, len);
			EVP_EncryptFinal_ex(c, out + o + got, &got);
			o += (size_t)len;
			EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, TAG, out + o);
			o += TAG;
		}
		if (send_all(l->to, out, o) < 0)
			break;
	}
	free(in);
	free(out);
	return ended;
}

static int open_leg(struct leg *l, EVP_CIPHER_CTX *c)
{
	size_t cap = READ_AT_ONCE + HEAD + RECORD + TAG;
	unsigned char *in = malloc(cap);
	unsigned char *out = malloc(cap);
	size_t have = 0;
	uint64_t seq = 0;
	int ended = -1;
	for (; in && out;) {
		ssize_t n = recv(l->from, in + have, cap - have, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			// A record cut off by the end is a failure, not an end.
			ended = n == 0 && have == 0 ? 0 : -1;
			break;
		}
		have += (size_t)n;
		size_t at = 0, o = 0;
		int bad = 0;
		while (have - at >= HEAD) {
			size_t len = (size_t)in[at] << 24 | (size_t)in[at + 1] << 16 |
				     (size_t)in[at + 2] << 8 | in[at + 3];
			if (len > RECORD) {
				bad = 1;
				break;
			}
			if (have - at < HEAD + len + TAG)
				break;
			unsigned char iv[12];
			int got;
			nonce(iv, l->dir, seq++);
			EVP_DecryptInit_ex(c, NULL, NULL, NULL, iv);
			EVP_DecryptUpdate(c, out + o, &got, in + at + HEAD, (int)len);
			EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, TAG, in + at + HEAD + len);
			if (EVP_DecryptFinal_ex(c, out + o + got, &got) <= 0) {
				bad = 1;
				break;
			}
			o += len;
			at += HEAD + len + TAG;
		}
		if (bad) {
			fprintf(stderr, "floor: a record failed its check; connection closed\n");
			break;
		}
		memmove(in, in + at, have - at);
		have -= at;
		if (o > 0 && send_all(l->to, out, o) < 0)
			break;
	}
	free(in);
	free(out);
	return ended;
}

static int splice_leg(struct leg *l)
{
	int p[2], ended = -1;
	if (pipe(p) < 0)
		return -1;
	fcntl(p[1], F_SETPIPE_SZ, 1 << 20);
	for (;;) {
		ssize_t n = splice(l->from, NULL, p[1], NULL, 1 << 20, SPLICE_F_MOVE);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			ended = n == 0 ? 0 : -1;
			break;
		}
		while (n > 0) {
			ssize_t w = splice(p[0], NULL, l->to, NULL, (size_t)n, SPLICE_F_MOVE);
			if (w < 0 && errno == EINTR)
				continue;
			if (w <= 0)
				goto out;
			n -= w;
		}
	}
out:
	close(p[0]);
	close(p[1]);
	return ended;
}

static void *run_leg(void *arg)
{
	struct leg *l = arg;
	int ended = -1;
	if (l->seal >= 0) {
		EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
		if (c && l->seal &&
		    EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), NULL, KEY, NULL) == 1)
			ended = seal_leg(l, c);
		else if (c && !l->seal &&
			 EVP_DecryptInit_ex(c, EVP_aes_256_gcm(), NULL, KEY, NULL) == 1)
			ended = open_leg(l, c);
		EVP_CIPHER_CTX_free(c);
	} else {
		ended = splice_leg(l);
	}
	if (ended == 0) {
		// A clean end is passed on; the other direction goes on (a
		// half-closed connection stays half open).
		shutdown(l->to, SHUT_WR);
	} else {
		// A failure ends both directions: the other's blocking read
		// returns, and the connection is let go.
		shutdown(l->from, SHUT_RDWR);
		shutdown(l->to, SHUT_RDWR);
	}
	return NULL;
}

// Carries `a` and `b` both ways until both directions end. `ab` and `ba`
// say what each direction does (-1 splice, 1 seal, 0 open).
static void carry(int a, int b, int ab, int ba, unsigned char dir_ab, unsigned char dir_ba)
{
	struct leg there = {.from = a, .to = b, .seal = ab, .dir = dir_ab};
	struct leg back = {.from = b, .to = a, .seal = ba, .dir = dir_ba};
	pthread_t t;
	if (pthread_create(&t, NULL, run_leg, &back) != 0) {
		close(a);
		close(b);
		return;
	}
	run_leg(&there);
	pthread_join(t, NULL);
	close(a);
	close(b);
}

// What the client's proxy sends first on a proxy-to-proxy connection: the
// original destination (address, port), 8 bytes.
static void *outbound(void *arg)
{
	int app = (int)(intptr_t)arg;
	struct sockaddr_in dst;
	socklen_t len = sizeof dst;
	if (getsockopt(app, SOL_IP, SO_ORIGINAL_DST, &dst, &len) < 0) {
		close(app);
		return NULL;
	}
	if (!is_meshed(dst.sin_addr)) {
		int up = dial(dst, NULL);
		if (up < 0) {
			close(app);
			return NULL;
		}
		carry(app, up, -1, -1, 0, 0);
		return NULL;
	}
	struct sockaddr_in peer = dst;
	peer.sin_port = htons(15008);
	int up = dial(peer, NULL);
	if (up < 0) {
		close(app);
		return NULL;
	}
	unsigned char head[8] = {0};
	memcpy(head, &dst.sin_addr, 4);
	memcpy(head + 4, &dst.sin_port, 2);
	if (send_all(up, head, sizeof head) < 0) {
		close(app);
		close(up);
		return NULL;
	}
	carry(app, up, 1, 0, 0, 1);
	return NULL;
}

static void *inbound(void *arg)
{
	int peer = (int)(intptr_t)arg;
	struct sockaddr_in from;
	socklen_t len = sizeof from;
	unsigned char head[8];
	if (getpeername(peer, (struct sockaddr *)&from, &len) < 0 ||
	    recv_all(peer, head, sizeof head) < 0) {
		close(peer);
		return NULL;
	}
	struct sockaddr_in dst = {.sin_family = AF_INET};
	memcpy(&dst.sin_addr, head, 4);
	memcpy(&dst.sin_port, head + 4, 2);
	int app = dial(dst, &from.sin_addr);
	if (app < 0) {
		close(peer);
		return NULL;
	}
	carry(peer, app, 0, 1, 0, 1);
	return NULL;
}

// A plaintext connection redirected to the inbound side: delivered as is.
static void *inbound_plain(void *arg)
{
	int c = (int)(intptr_t)arg;
	struct sockaddr_in dst, from;
	socklen_t len = sizeof dst, flen = sizeof from;
	if (getsockopt(c, SOL_IP, SO_ORIGINAL_DST, &dst, &len) < 0 ||
	    getpeername(c, (struct sockaddr *)&from, &flen) < 0) {
		close(c);
		return NULL;
	}
	int app = dial(dst, &from.sin_addr);
	if (app < 0) {
		close(c);
		return NULL;
	}
	carry(c, app, -1, -1, 0, 0);
	return NULL;
}

static void *ready(void *arg)
{
	int l = (int)(intptr_t)arg;
	static const char answer[] =
		"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\nready\n";
	for (;;) {
		int c = accept(l, NULL, NULL);
		if (c < 0)
			continue;
		char req[1024];
		(void)!recv(c, req, sizeof req, 0);
		send_all(c, (const unsigned char *)answer, sizeof answer - 1);
		close(c);
	}
	return NULL;
}

static int listen_on(const char *addr, int port)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	if (fd < 0)
		die("socket");
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, addr, &a.sin_addr);
	if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0)
		die("bind");
	if (listen(fd, 4096) < 0)
		die("listen");
	return fd;
}

struct listener {
	int fd;
	void *(*serve)(void *);
};

static void *accept_loop(void *arg)
{
	struct listener *l = arg;
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&attr, 256 * 1024);
	for (;;) {
		int c = accept(l->fd, NULL, NULL);
		if (c < 0) {
			if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE)
				continue;
			die("accept");
		}
		tune(c);
		pthread_t t;
		if (pthread_create(&t, &attr, l->serve, (void *)(intptr_t)c) != 0)
			close(c);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc < 2 || strcmp(argv[1], "proxy") != 0) {
		fprintf(stderr, "usage: floor proxy   (LOCAL_XDS_PATH=mesh.yaml)\n");
		return 2;
	}
	const char *mesh = getenv("LOCAL_XDS_PATH");
	if (!mesh) {
		fprintf(stderr, "floor: LOCAL_XDS_PATH is not set\n");
		return 2;
	}
	read_mesh(mesh);
	signal(SIGPIPE, SIG_IGN);
	static struct listener ls[3];
	ls[0] = (struct listener){listen_on("0.0.0.0", 15001), outbound};
	ls[1] = (struct listener){listen_on("0.0.0.0", 15008), inbound};
	ls[2] = (struct listener){listen_on("0.0.0.0", 15006), inbound_plain};
	for (int i = 0; i < 3; i++) {
		pthread_t t;
		if (pthread_create(&t, NULL, accept_loop, &ls[i]) != 0)
			die("pthread_create");
	}
	fprintf(stderr, "floor: listening; %d meshed addresses\n", n_meshed);
	ready((void *)(intptr_t)listen_on("127.0.0.1", 15021));
	return 0;
}
