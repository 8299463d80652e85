// relay: a minimal TCP relay, to measure what the kernel lets any relay in
// a proxy's place reach. One process per connection (fork), no event loop.
//
//   relay MODE LISTEN_ADDR:PORT DEST_ADDR:PORT
//
// MODE is one of
//   copy     read(2) into a 256 KiB buffer and write(2) it on (what a
//            user-space copy such as ztunnel's does)
//   splice   splice(2) through a 1 MiB pipe (what Ambit's passthrough does)
//   zerocopy read(2) as copy does, and send(2) with MSG_ZEROCOPY from a ring
//            of 8 buffers, each reused once the kernel says it is done with
//            it; on SIGTERM it also prints how many sends the kernel
//            completed by copying after all (SO_EE_CODE_ZEROCOPY_COPIED)
//   sockmap  the kernel moves the bytes itself (a BPF sk_skb verdict
//            program redirects each received segment to the peer socket;
//            needs verdict.bpf.o beside the binary)
//   shortcut the application's connection to the relay does not cross TCP:
//            a sock_ops program on the cgroup v2 root puts both of its ends
//            in a sockhash, and an sk_msg program hands each send straight
//            to the other end's receive queue; the relay copies to and from
//            the server (needs shortcut.bpf.o beside the binary; the
//            programs go when the relay exits)
//
// On SIGTERM it prints the CPU time its connections used (user + system,
// seconds, children included) and exits.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <linux/errqueue.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>

struct tuple {
	unsigned int local_ip4, remote_ip4, local_port, remote_port;
};

static int map_fd = -1;

static void die(const char *what)
{
	perror(what);
	exit(1);
}

static struct sockaddr_in parse(const char *s)
{
	struct sockaddr_in a = {.sin_family = AF_INET};
	char host[64];
	const char *colon = strrchr(s, ':');
	if (!colon || colon - s >= (long)sizeof host) {
		fprintf(stderr, "relay: not ADDR:PORT: %s\n", s);
		exit(2);
	}
	memcpy(host, s, colon - s);
	host[colon - s] = 0;
	if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
		fprintf(stderr, "relay: not an IPv4 address: %s\n", host);
		exit(2);
	}
	a.sin_port = htons(atoi(colon + 1));
	return a;
}

struct leg {
	int from, to;
};

static void *copy_leg(void *p)
{
	struct leg *l = p;
	static __thread char buf[256 * 1024];
	for (;;) {
		ssize_t n = read(l->from, buf, sizeof buf);
		if (n <= 0)
			break;
		for (ssize_t off = 0; off < n;) {
			ssize_t w = write(l->to, buf + off, n - off);
			if (w <= 0)
				goto out;
			off += w;
		}
	}
out:
	shutdown(l->to, SHUT_WR);
	return NULL;
}

// Zero-copy sends: every completion the kernel reports on the error queue
// ends the sends of a range of ids; a completion marked COPIED means the
// kernel copied the bytes anyway (as it must when the receiver is a local
// socket). Counts go to the shared page the parent reads at the end.
struct zc_counts {
	unsigned long sends, copied_ranges, ranges;
};
static struct zc_counts *zc;

// Reads completions until send id `upto` (exclusive) is done.
static int zc_wait(int fd, unsigned int *done, unsigned int upto)
{
	while ((int)(upto - *done) > 0) {
		char control[128];
		struct msghdr m = {.msg_control = control, .msg_controllen = sizeof control};
		if (recvmsg(fd, &m, MSG_ERRQUEUE) < 0) {
			if (errno == EAGAIN || errno == EINTR) {
				struct pollfd p = {fd, 0, 0};
				poll(&p, 1, 100);
				continue;
			}
			return -1;
		}
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
			struct sock_extended_err *e = (void *)CMSG_DATA(c);
			if (e->ee_origin != SO_EE_ORIGIN_ZEROCOPY)
				continue;
			__atomic_add_fetch(&zc->ranges, 1, __ATOMIC_RELAXED);
			if (e->ee_code & SO_EE_CODE_ZEROCOPY_COPIED)
				__atomic_add_fetch(&zc->copied_ranges, 1, __ATOMIC_RELAXED);
			*done = e->ee_data + 1;
		}
	}
	return 0;
}

static void *zerocopy_leg(void *p)
{
	struct leg *l = p;
	enum { RING = 8, SIZE = 256 * 1024 };
	char *ring = malloc((size_t)RING * SIZE);
	// The id after the last send from each slot: the slot is free once
	// every id before it is done.
	unsigned int after[RING] = {0}, sent = 0, done = 0;
	int one = 1;
	if (!ring || setsockopt(l->to, SOL_SOCKET, SO_ZEROCOPY, &one, sizeof one) < 0)
		die("SO_ZEROCOPY");
	for (unsigned long turn = 0;; turn++) {
		unsigned int slot = turn % RING;
		if (zc_wait(l->to, &done, after[slot]) < 0)
			break;
		char *buf = ring + (size_t)slot * SIZE;
		ssize_t n = read(l->from, buf, SIZE);
		if (n <= 0)
			break;
		for (ssize_t off = 0; off < n;) {
			ssize_t w = send(l->to, buf + off, n - off, MSG_ZEROCOPY);
			if (w < 0 && errno == ENOBUFS) {
				// Over the socket's optmem for pending notifications.
				if (sent == done || zc_wait(l->to, &done, done + 1) < 0)
					goto out;
				continue;
			}
			if (w <= 0)
				goto out;
			// Each successful send is one id, however many bytes it took.
			sent++;
			__atomic_add_fetch(&zc->sends, 1, __ATOMIC_RELAXED);
			off += w;
		}
		after[slot] = sent;
	}
out:
	zc_wait(l->to, &done, sent);
	shutdown(l->to, SHUT_WR);
	free(ring);
	return NULL;
}

static void *splice_leg(void *p)
{
	struct leg *l = p;
	int pipefd[2];
	if (pipe(pipefd) < 0)
		die("pipe");
	fcntl(pipefd[1], F_SETPIPE_SZ, 1 << 20);
	for (;;) {
		ssize_t n = splice(l->from, NULL, pipefd[1], NULL, 1 << 20, SPLICE_F_MOVE);
		if (n <= 0)
			break;
		while (n > 0) {
			ssize_t w = splice(pipefd[0], NULL, l->to, NULL, n, SPLICE_F_MOVE);
			if (w <= 0)
				goto out;
			n -= w;
		}
	}
out:
	shutdown(l->to, SHUT_WR);
	return NULL;
}

static struct tuple own(int fd)
{
	struct sockaddr_in local, remote;
	socklen_t len = sizeof local;
	if (getsockname(fd, (struct sockaddr *)&local, &len) < 0)
		die("getsockname");
	len = sizeof remote;
	if (getpeername(fd, (struct sockaddr *)&remote, &len) < 0)
		die("getpeername");
	struct tuple t = {
		.local_ip4 = local.sin_addr.s_addr,
		.remote_ip4 = remote.sin_addr.s_addr,
		.local_port = ntohs(local.sin_port),
		// __sk_buff gives the remote port in network byte order in the
		// upper half of its 32 bits (on little-endian machines).
		.remote_port = (unsigned int)remote.sin_port << 16,
	};
	return t;
}

// The kernel carries the bytes; this process only waits for both ends.
static void sockmap_pair(int a, int b)
{
	struct tuple ta = own(a), tb = own(b);
	// A segment received on `a` goes out on `b`, and back.
	if (bpf_map_update_elem(map_fd, &tb, &a, BPF_ANY) < 0)
		die("sockhash insert");
	if (bpf_map_update_elem(map_fd, &ta, &b, BPF_ANY) < 0)
		die("sockhash insert");
	// What arrived before the insert sits in the socket's queue, where the
	// program never sees it: send it on by hand. (A segment arriving while
	// this runs could overtake it; a real proxy would have to rule that out.)
	for (int i = 0; i < 2; i++) {
		char buf[65536];
		ssize_t n;
		while ((n = recv(i ? b : a, buf, sizeof buf, MSG_DONTWAIT)) > 0)
			if (write(i ? a : b, buf, n) != n)
				die("forwarding the queued bytes");
	}
	struct pollfd p[2] = {{a, POLLRDHUP, 0}, {b, POLLRDHUP, 0}};
	int shut[2] = {0, 0};
	while (!shut[0] || !shut[1]) {
		if (poll(p, 2, -1) < 0 && errno != EINTR)
			die("poll");
		for (int i = 0; i < 2; i++) {
			if (!shut[i] && (p[i].revents & (POLLRDHUP | POLLHUP | POLLERR))) {
				shut[i] = 1;
				p[i].events = 0;
				// Give the kernel's queue to the peer a moment to drain.
				usleep(20000);
				shutdown(i ? a : b, SHUT_WR);
			}
		}
	}
	bpf_map_delete_elem(map_fd, &ta);
	bpf_map_delete_elem(map_fd, &tb);
}

static void serve(const char *mode, int client, struct sockaddr_in dest)
{
	int up = socket(AF_INET, SOCK_STREAM, 0);
	if (up < 0 || connect(up, (struct sockaddr *)&dest, sizeof dest) < 0)
		die("connect");
	int one = 1;
	setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	setsockopt(up, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	if (!strcmp(mode, "sockmap")) {
		sockmap_pair(client, up);
		return;
	}
	void *(*leg)(void *) = !strcmp(mode, "splice")	  ? splice_leg
			       : !strcmp(mode, "zerocopy") ? zerocopy_leg
							   : copy_leg;
	struct leg there = {client, up}, back = {up, client};
	pthread_t t;
	if (pthread_create(&t, NULL, leg, &back))
		die("pthread_create");
	leg(&there);
	pthread_join(t, NULL);
}

static struct bpf_object *load(const char *argv0, const char *name)
{
	char path[PATH_MAX];
	const char *slash = strrchr(argv0, '/');
	if (slash)
		snprintf(path, sizeof path, "%.*s/%s", (int)(slash - argv0), argv0, name);
	else
		snprintf(path, sizeof path, "%s", name);
	struct bpf_object *obj = bpf_object__open_file(path, NULL);
	if (!obj || bpf_object__load(obj)) {
		fprintf(stderr, "relay: cannot load %s\n", path);
		exit(1);
	}
	return obj;
}

static volatile sig_atomic_t stopping;

static void on_term(int sig)
{
	(void)sig;
	stopping = 1;
}

int main(int argc, char **argv)
{
	if (argc != 4 || (strcmp(argv[1], "copy") && strcmp(argv[1], "splice") &&
			  strcmp(argv[1], "zerocopy") && strcmp(argv[1], "sockmap") &&
			  strcmp(argv[1], "shortcut"))) {
		fprintf(stderr,
			"usage: relay copy|splice|zerocopy|sockmap|shortcut LISTEN:PORT DEST:PORT\n");
		return 2;
	}
	struct sockaddr_in listen_at = parse(argv[2]), dest = parse(argv[3]);
	// Shared with the forked connections, for the zerocopy counts.
	zc = mmap(NULL, sizeof *zc, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (zc == MAP_FAILED)
		die("mmap");
	if (!strcmp(argv[1], "sockmap")) {
		struct bpf_object *obj = load(argv[0], "verdict.bpf.o");
		map_fd = bpf_object__find_map_fd_by_name(obj, "peers");
		struct bpf_program *prog = bpf_object__find_program_by_name(obj, "verdict");
		if (map_fd < 0 || !prog)
			die("verdict.bpf.o has no peers map or verdict program");
		if (bpf_prog_attach(bpf_program__fd(prog), map_fd, BPF_SK_SKB_STREAM_VERDICT, 0))
			die("attaching the verdict program");
	}
	if (!strcmp(argv[1], "shortcut")) {
		struct bpf_object *obj = load(argv[0], "shortcut.bpf.o");
		int ends = bpf_object__find_map_fd_by_name(obj, "ends");
		struct bpf_program *capture = bpf_object__find_program_by_name(obj, "capture");
		struct bpf_program *shortcut = bpf_object__find_program_by_name(obj, "shortcut");
		if (ends < 0 || !capture || !shortcut)
			die("shortcut.bpf.o has no ends map, capture or shortcut program");
		if (bpf_prog_attach(bpf_program__fd(shortcut), ends, BPF_SK_MSG_VERDICT, 0))
			die("attaching the sk_msg program");
		const char *root = access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0
					   ? "/sys/fs/cgroup"
					   : "/sys/fs/cgroup/unified";
		int cg = open(root, O_RDONLY | O_DIRECTORY);
		// A link, not an attachment: it goes when this process does.
		if (cg < 0 || !bpf_program__attach_cgroup(capture, cg))
			die("attaching the sock_ops program to the cgroup v2 root");
	}
	int l = socket(AF_INET, SOCK_STREAM, 0);
	int one = 1;
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(l, (struct sockaddr *)&listen_at, sizeof listen_at) < 0 || listen(l, 128) < 0)
		die("listen");
	// Its own process group, so that ending stragglers ends nothing else.
	setpgid(0, 0);
	struct sigaction sa = {.sa_handler = on_term};
	sigaction(SIGTERM, &sa, NULL);
	signal(SIGCHLD, SIG_DFL);
	printf("ready\n");
	fflush(stdout);
	while (!stopping) {
		int c = accept(l, NULL, NULL);
		if (c < 0) {
			if (errno == EINTR)
				continue;
			die("accept");
		}
		pid_t pid = fork();
		if (pid == 0) {
			signal(SIGTERM, SIG_DFL);
			close(l);
			serve(argv[1], c, dest);
			_exit(0);
		}
		close(c);
		while (waitpid(-1, NULL, WNOHANG) > 0)
			;
	}
	// The connections have ended by now (the run is over): reap them, and
	// end any still open after a second, then report their CPU.
	for (int waited = 0; waited < 100; waited++) {
		while (waitpid(-1, NULL, WNOHANG) > 0)
			;
		if (waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD)
			break;
		usleep(10000);
	}
	signal(SIGTERM, SIG_IGN);
	kill(0, SIGTERM);
	while (wait(NULL) > 0)
		;
	struct rusage ru;
	getrusage(RUSAGE_CHILDREN, &ru);
	if (!strcmp(argv[1], "zerocopy"))
		printf("zerocopy sends %lu, completions %lu, of them copied %lu\n", zc->sends,
		       zc->ranges, zc->copied_ranges);
	printf("cpu %.3f\n", ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
				     ru.ru_stime.tv_usec / 1e6);
	return 0;
}
