// The sockmap relay's one program: every segment a relayed socket receives
// is sent on by the kernel from its peer socket, found by the receiving
// socket's own addresses. No wake-up of the relay, no copy, no pipe.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct tuple {
	__u32 local_ip4;
	__u32 remote_ip4;
	__u32 local_port;  // host byte order, as __sk_buff gives it
	__u32 remote_port; // as __sk_buff gives it: network byte order, upper half
};

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 1024);
	__type(key, struct tuple);
	__type(value, __u32);
} peers SEC(".maps");

SEC("sk_skb/stream_verdict")
int verdict(struct __sk_buff *skb)
{
	struct tuple t = {
		.local_ip4 = skb->local_ip4,
		.remote_ip4 = skb->remote_ip4,
		.local_port = skb->local_port,
		.remote_port = skb->remote_port,
	};
	return bpf_sk_redirect_hash(skb, &peers, &t, 0);
}

char LICENSE[] SEC("license") = "GPL";
