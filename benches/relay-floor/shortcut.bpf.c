// The `shortcut` relay's programs: the application's connection to the
// relay never crosses TCP. A sock_ops program puts both of its ends (the
// application's socket and the relay's accepted one) in `ends`, keyed by
// each socket's own addresses; an sk_msg program hands every send on either
// end straight to the other end's receive queue.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

struct tuple {
	__u32 local_ip4;
	__u32 remote_ip4;
	__u32 local_port;  // host byte order
	__u32 remote_port; // host byte order
};

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 1024);
	__type(key, struct tuple);
	__type(value, __u32);
} ends SEC(".maps");

// The relay's port (host byte order), set by the relay before loading.
const volatile __u32 relay_port = 7000;

// sock_ops and sk_msg give the remote port in network byte order, in the
// upper half of the 32 bits on some kernels and the lower on others.
static __always_inline __u32 port_of(__u32 raw)
{
	__u16 p = (raw & 0xffff) ? (__u16)raw : (__u16)(raw >> 16);
	return bpf_ntohs(p);
}

SEC("sockops")
int capture(struct bpf_sock_ops *ops)
{
	if (ops->op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB &&
	    ops->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	if (ops->family != 2 /* AF_INET */)
		return 1;
	struct tuple t = {
		.local_ip4 = ops->local_ip4,
		.remote_ip4 = ops->remote_ip4,
		.local_port = ops->local_port,
		.remote_port = port_of(ops->remote_port),
	};
	if (t.local_port != relay_port && t.remote_port != relay_port)
		return 1;
	bpf_sock_hash_update(ops, &ends, &t, BPF_ANY);
	return 1;
}

SEC("sk_msg")
int shortcut(struct sk_msg_md *msg)
{
	// The other end's own addresses are this end's, swapped.
	struct tuple peer = {
		.local_ip4 = msg->remote_ip4,
		.remote_ip4 = msg->local_ip4,
		.local_port = port_of(msg->remote_port),
		.remote_port = msg->local_port,
	};
	// Not found (the other end not in yet): the send goes by TCP.
	bpf_msg_redirect_hash(msg, &ends, &peer, BPF_F_INGRESS);
	return SK_PASS;
}

char LICENSE[] SEC("license") = "GPL";
