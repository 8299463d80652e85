#!/usr/bin/env python3
"""Writes the committed seed inputs, fuzz/corpus/<target>/seed-*.

Each seed is a small valid input that reaches the code behind a target's
first checks; libFuzzer mutates from there. Binary seeds (protobuf, DNS) are
built here by hand, field by field, so what each one holds is readable.
Run it again after changing a seed: `python3 fuzz/make_seeds.py`.
"""

import ipaddress
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# -- protobuf, by hand -------------------------------------------------------

def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def num(field, v):
    return varint(field << 3) + varint(v)


def msg(field, body):
    if isinstance(body, str):
        body = body.encode()
    return varint(field << 3 | 2) + varint(len(body)) + body


def packed(field, values):
    return msg(field, b"".join(varint(v) for v in values))


def ip(text):
    return ipaddress.ip_address(text).packed


# -- ZDS (proto/zds.proto) ---------------------------------------------------

def zds():
    info = msg(1, "web-0") + msg(2, "shop") + msg(3, "web-sa")
    write("zds_messages", "hello", num(1, 1))
    write("zds_messages", "add", msg(1, msg(1, "uid-web-0") + msg(2, info)))
    write("zds_messages", "keep", msg(5, msg(1, "uid-web-0")))
    write("zds_messages", "del", msg(2, msg(2, "uid-web-0")))
    write("zds_messages", "snapshot-sent", msg(3, b""))
    write("zds_messages", "ack", msg(1, b""))
    write("zds_messages", "ack-error", msg(1, msg(1, "pod uid-web-0: fd is not a network namespace")))


# -- xDS (proto/workload.proto, proto/authorization.proto) --------------------
# Input format of xds_resources: [kind: 0 Address, 1 Authorization][u16 LE length][body]...

def chunk(kind, body):
    return bytes([kind]) + struct.pack("<H", len(body)) + body


def workload(uid, name, ns, addrs):
    waypoint = msg(1, msg(1, ns) + msg(2, "waypoint." + ns + ".svc.cluster.local")) + num(3, 15008)
    ports = msg(1, num(1, 80) + num(2, 8080))
    service = msg(1, ns + "/web." + ns + ".svc.cluster.local") + msg(2, ports)
    body = (
        msg(20, uid) + msg(1, name) + msg(2, ns)
        + b"".join(msg(3, ip(a)) for a in addrs)
        + num(5, 1)                       # HBONE
        + msg(7, "web-sa") + msg(8, waypoint) + msg(9, "node-1")
        + msg(10, "web") + msg(11, "v1") + num(12, 2)  # POD
        + msg(13, "web") + msg(22, service) + msg(18, "Kubernetes")
        + msg(16, ns + "/allow-front")
        + msg(24, msg(1, "eu-west") + msg(2, "eu-west-1a"))
        + msg(27, num(1, 2))              # capacity
    )
    return msg(1, body)


def service(load_balancing=False):
    weighted = msg(1, msg(2, msg(2, ip("10.0.0.9"))) + num(3, 15008)) + num(2, 3)
    body = (
        msg(1, "web") + msg(2, "shop") + msg(3, "web.shop.svc.cluster.local")
        + msg(4, msg(2, ip("10.96.0.10")))
        + msg(4, msg(2, ip("fd00::10")) + num(3, 128))
        + msg(5, num(1, 80) + num(2, 8080) + num(3, 1))   # HTTP11
        + msg(5, num(1, 443) + num(2, 8443))
        + msg(6, "spiffe://cluster.local/ns/shop/sa/web-sa")
        + num(9, 3)                                     # DUAL
        + num(11, 1) + msg(13, weighted) + num(14, 1)   # canonical, NAMESPACE
    )
    if load_balancing:
        body += msg(8, packed(1, [1, 2]) + num(2, 2) + num(3, 1))
    return msg(2, body)


def policy():
    match = (
        msg(1, msg(1, "shop"))                                  # namespaces: exact
        + msg(3, msg(2, "spiffe://cluster.local/ns/shop/"))     # principals: prefix
        + msg(4, msg(4, b""))                                   # not_principals: presence
        + msg(5, msg(1, ip("10.0.0.0")) + num(2, 8))            # source_ips
        + msg(8, msg(1, ip("fd00::")) + num(2, 64))             # not_destination_ips
        + packed(9, [8080, 443])
        + msg(11, msg(1, "shop") + msg(2, "front"))
    )
    body = (
        msg(1, "allow-front") + msg(2, "shop") + num(3, 1) + num(4, 0)
        + msg(5, msg(1, msg(2, match)))
    )
    return body


def xds():
    w = workload("Kubernetes//Pod/shop/web-0", "web-0", "shop", ["10.0.0.7", "fd00::7"])
    write("xds_resources", "workload", chunk(0, w))
    write("xds_resources", "service", chunk(0, service()))
    write("xds_resources", "service-load-balancing", chunk(0, service(True)))
    write("xds_resources", "policy", chunk(1, policy()))
    # Two workloads claiming one address, a service they back, and a policy.
    other = workload("Kubernetes//Pod/shop/web-1", "web-1", "shop", ["10.0.0.7"])
    write("xds_resources", "mesh", chunk(0, w) + chunk(0, other) + chunk(0, service()) + chunk(1, policy()))


# -- DNS ---------------------------------------------------------------------

def qname(name):
    return b"".join(bytes([len(l)]) + l.encode() for l in name.split(".") if l) + b"\x00"


def query(qid, name, qtype, questions=1, flags=0x0100, extra=b"", additional=0):
    header = struct.pack(">HHHHHH", qid, flags, questions, 0, 0, additional)
    q = qname(name) + struct.pack(">HH", qtype, 1)
    return header + q * questions + extra


A, AAAA, OPT, CNAME = 1, 28, 41, 5


def dns():
    write("dns_query", "full-name-a", query(0x1234, "echo.shop.svc.cluster.local", A))
    write("dns_query", "short-name-aaaa", query(0x2345, "echo", AAAA))
    write("dns_query", "headless", query(0x3456, "db.data", A))
    write("dns_query", "search-expanded", query(0x4567, "pay.example.com.shop.svc.cluster.local", A))
    write("dns_query", "forwarded", query(0x5678, "www.example.org", A))
    write("dns_query", "two-questions", query(0x6789, "echo", A, questions=2))
    # EDNS: an OPT record (root name, 1232-byte payload) in the additional section.
    opt = b"\x00" + struct.pack(">HHIH", OPT, 1232, 0, 0)
    write("dns_query", "edns", query(0x789A, "echo.shop", A, extra=opt, additional=1))
    write("dns_query", "response-bit", query(0x89AB, "echo", A, flags=0x8180))
    # Answers to the on-demand resolver's question for api.example.com
    # (id 0x0A0A; fuzz_targets/dns_answer.rs asks A, or AAAA when the
    # first byte is odd: the knob byte comes first).
    api = "api.example.com"
    name_ptr = b"\xc0\x0c"  # the question's name
    def rr(owner, rtype, ttl, rdata):
        return owner + struct.pack(">HHIH", rtype, 1, ttl, len(rdata)) + rdata
    a_rec = rr(name_ptr, A, 60, bytes([192, 0, 2, 7]))
    write("dns_answer", "a", b"\x00" + query(0x0A0A, api, A, flags=0x8180)[:4] + struct.pack(">HHHH", 1, 1, 0, 0) + query(0x0A0A, api, A)[12:] + a_rec)
    cname = rr(name_ptr, CNAME, 300, qname("edge.cdn.example"))
    edge = rr(qname("edge.cdn.example"), A, 20, bytes([192, 0, 2, 9]))
    write("dns_answer", "cname-chain", b"\x00" + query(0x0A0A, api, A, flags=0x8180)[:4] + struct.pack(">HHHH", 1, 2, 0, 0) + query(0x0A0A, api, A)[12:] + cname + edge)
    aaaa = rr(name_ptr, AAAA, 60, bytes(15) + b"\x07")
    write("dns_answer", "aaaa", b"\x01" + query(0x0A0A, api, AAAA, flags=0x8180)[:4] + struct.pack(">HHHH", 1, 1, 0, 0) + query(0x0A0A, api, AAAA)[12:] + aaaa)
    write("dns_answer", "nxdomain", b"\x00" + query(0x0A0A, api, A, flags=0x8183))


# -- CRLs --------------------------------------------------------------------

def crl():
    """A CA and a v2 CRL revoking two serials, made by openssl (a CRL must
    be signed; building one by hand would be most of this file)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        def run(*args):
            subprocess.run(args, cwd=d, check=True, capture_output=True)

        run("openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key")
        run("openssl", "req", "-x509", "-new", "-key", "ca.key", "-subj", "/O=seed/CN=seed CA",
            "-days", "3650", "-out", "ca.pem", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        with open(os.path.join(d, "index.txt"), "w") as f:
            for serial in ("1A2B", "03"):
                f.write(f"R\t300101000000Z\t250101000000Z,keyCompromise\t{serial}\tunknown\t/CN=revoked\n")
        with open(os.path.join(d, "crlnumber"), "w") as f:
            f.write("01\n")
        with open(os.path.join(d, "ca.cnf"), "w") as f:
            f.write("[ca]\ndefault_ca = seed\n[seed]\ndatabase = index.txt\ncrlnumber = crlnumber\n"
                    "default_md = sha256\ndefault_crl_days = 3650\ncrl_extensions = ext\n"
                    "[ext]\nauthorityKeyIdentifier = keyid:always\n")
        run("openssl", "ca", "-gencrl", "-config", "ca.cnf", "-keyfile", "ca.key", "-cert", "ca.pem",
            "-out", "crl.pem")
        run("openssl", "crl", "-in", "crl.pem", "-outform", "DER", "-out", "crl.der")
        pem = open(os.path.join(d, "crl.pem"), "rb").read()
        ca = open(os.path.join(d, "ca.pem"), "rb").read()
        der = open(os.path.join(d, "crl.der"), "rb").read()
    write("crl_file", "pem", pem)
    write("crl_file", "der", der)
    write("crl_file", "pem-two-and-a-cert", ca + pem + pem)


# -- text seeds --------------------------------------------------------------

def cni():
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c0ffee",
        "CNI_NETNS": "/var/run/netns/cni-1234",
        "CNI_IFNAME": "eth0",
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_UID=uid-web-0",
        "CNI_PATH": "/opt/cni/bin",
    }
    prev = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/cni-1234"}],
        "ips": [
            {"interface": 0, "address": "10.244.1.5/24", "gateway": "10.244.1.1"},
            {"interface": 0, "address": "fd00::5/64"},
        ],
        "dns": {},
    }

    def seed(name, agent, env_changes, config):
        e = dict(env, **env_changes)
        text = "".join(f"{k}={v}\n" for k, v in e.items() if v is not None)
        write("cni_plugin", name, f"{agent}\n{text}\n{json.dumps(config)}")

    base = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "ambit-cni",
            "cni_agent_run_dir": "/var/run/ambit", "prevResult": prev}
    seed("add-enroll", 0, {}, base)
    seed("add-refused", 1, {}, dict(base, enroll={"mode": "namespaces", "namespaces": ["shop"]}))
    seed("add-0.3.1", 0, {}, dict(base, cniVersion="0.3.1", enroll={"mode": "pod_pattern", "pod_pattern": "web-*"}))
    seed("add-kubernetes-no-agent", 3, {}, dict(base, enroll={
        "mode": "kubernetes", "agent_namespace": "istio-system", "agent_pod_prefix": "ambit-"}))
    seed("add-excluded", 0, {"CNI_ARGS": "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1"}, base)
    seed("del-legacy-address", 0, {"CNI_COMMAND": "DEL", "CNI_NETNS": None},
         {"cniVersion": "0.4.0", "cni_event_address": "/var/run/istio-cni/pluginevent.sock"})
    seed("check", 0, {"CNI_COMMAND": "CHECK"}, dict(base, enroll={"mode": "none"}))
    seed("version", 0, {"CNI_COMMAND": "VERSION"}, {"cniVersion": "0.3.0"})


def agent():
    event = {
        "Netns": "/var/run/netns/cni-1234", "PodName": "web-0", "PodNamespace": "shop",
        "PodUID": "uid-web-0", "ContainerID": "c0ffee",
        "IPs": [{"Interface": 0, "Address": "10.244.1.5/24", "Gateway": "10.244.1.1"},
                {"Interface": 0, "Address": "fd00::5/64", "Gateway": None}],
    }
    write("agent_event", "ambit", json.dumps(event))
    # As Istio's plugin sends it: no PodUID or ContainerID, the address a Go net.IPNet.
    istio = {"Netns": "/proc/4242/ns/net", "PodName": "db-0", "PodNamespace": "data",
             "IPs": [{"Address": {"IP": "10.244.1.6", "Mask": "////AA=="}, "Gateway": "10.244.1.1"}]}
    write("agent_event", "istio", json.dumps(istio))


def hbone():
    write("hbone_connect", "direct",
          '0\nCONNECT 10.0.0.3:8080\nforwarded: for="10.0.0.2:40000"\n'
          "baggage: k8s.cluster.name=east,k8s.namespace.name=shop,k8s.deployment.name=front\n"
          "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00\n")
    write("hbone_connect", "waypoint",
          '4\nCONNECT 10.96.0.10:80\nforwarded: for="10.0.0.2:40000";host=echo.shop.svc.cluster.local\n')
    write("hbone_connect", "v6",
          '2\nCONNECT [fd00::3]:443\nforwarded: for="[fd00::2]:50000"\n')
    write("hbone_connect", "v4-mapped", '1\nCONNECT 10.0.0.3:9090\nforwarded: for="10.0.0.2:1"\n')
    write("hbone_connect", "proxy-port", "0\nCONNECT 10.0.0.3:15008\n")
    write("hbone_connect", "not-connect", "0\nGET http://10.0.0.3:80/\nhost: 10.0.0.3\n")


def local_config():
    write("local_config", "mesh.yaml", """\
workloads:
- uid: Kubernetes//Pod/shop/front-0
  name: front-0
  namespace: shop
  serviceAccount: front
  workloadIps: ["10.0.0.2"]
  protocol: HBONE
  node: node-1
- name: web-0
  namespace: shop
  workloadIps: ["10.0.0.3", "fd00::3"]
  protocol: HBONE
  workloadType: pod
  authorizationPolicies: [shop/web-only]
  waypoint: {destination: shop/waypoint.shop.svc.cluster.local}
  services:
    "shop/web.shop.svc.cluster.local": {80: 8080}
- name: legacy-0
  namespace: old
  workloadIps: ["10.0.0.4"]
  status: Unhealthy
services:
- name: web
  namespace: shop
  hostname: web.shop.svc.cluster.local
  vips: ["/10.96.0.20", "/fd00::20"]
  ports: {80: 8080}
  subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/web"]
policies:
- name: web-only
  namespace: shop
  scope: WorkloadSelector
  action: Allow
  rules: [[[{principals: [!Exact cluster.local/ns/shop/sa/front]}, {sourceIps: [10.0.0.0/8], destinationPorts: [8080]}]]]
- name: no-old
  namespace: shop
  scope: Namespace
  action: Deny
  rules:
  - - - namespaces: [!Prefix ol, {Suffix: d}]
        notPrincipals: [Presence]
""")
    write("local_config", "proxy.yaml", """\
proxy_mode: dedicated
workload_info: shop/web-0/web
local_xds_path: /etc/ambit/mesh.yaml
pod_name: web-0
pod_namespace: shop
instance_ip: 10.0.0.3
cluster_domain: cluster.local.
cert_ttl: 24h
packet_mark: 0x539
dns_upstreams: "10.96.0.10:53, [fd00::a]:53"
termination_grace_period: 30
congestion_control: bbr
""")
    write("local_config", "empty.yaml", "")


if __name__ == "__main__":
    zds()
    xds()
    dns()
    crl()
    cni()
    agent()
    hbone()
    local_config()
