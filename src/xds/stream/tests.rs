use std::collections::VecDeque;

use bytes::{Buf, Bytes};
use hyper::body::Frame;
use prost::Message;
use tonic::{Code, Status};

use super::{Front, Responses};
use crate::proto::discovery::{DeltaDiscoveryResponse, Resource};
use crate::xds::delta::Delta;

fn response(n: usize) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: "type.googleapis.com/istio.workload.Address".into(),
        nonce: format!("n{n}"),
        resources: (0..n)
            .map(|i| Resource {
                name: format!("resource-{i}"),
                resource: Some(prost_types::Any {
                    type_url: "type.googleapis.com/istio.workload.Address".into(),
                    value: vec![i as u8; 40],
                }),
                ..Default::default()
            })
            .collect(),
        removed_resources: vec!["gone".into()],
        ..Default::default()
    }
}

/// `m` as a gRPC message on the wire: its prefix, then its bytes.
fn framed(m: &impl Message) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// A 200 response whose body is `frames`, each a data frame or trailers.
fn http_response(
    headers: &[(&'static str, &'static str)],
    frames: Vec<Frame<Bytes>>,
    then_wait: bool,
) -> http::Response<tonic::body::BoxBody> {
    use futures_util::StreamExt;
    let items = futures_util::stream::iter(frames.into_iter().map(Ok::<_, Status>));
    let body: tonic::body::BoxBody = if then_wait {
        tonic::body::boxed(http_body_util::StreamBody::new(
            items.chain(futures_util::stream::pending()),
        ))
    } else {
        tonic::body::boxed(http_body_util::StreamBody::new(items))
    };
    let mut r = http::Response::new(body);
    for (k, v) in headers {
        r.headers_mut().insert(*k, v.parse().unwrap());
    }
    r
}

fn data(bytes: &[u8], piece: usize) -> Vec<Frame<Bytes>> {
    bytes
        .chunks(piece)
        .map(|c| Frame::data(Bytes::copy_from_slice(c)))
        .collect()
}

fn trailers(status: &str, message: &str) -> Frame<Bytes> {
    let mut t = http::HeaderMap::new();
    t.insert("grpc-status", status.parse().unwrap());
    if !message.is_empty() {
        t.insert("grpc-message", message.parse().unwrap());
    }
    Frame::trailers(t)
}

fn then(mut frames: Vec<Frame<Bytes>>, last: Frame<Bytes>) -> Vec<Frame<Bytes>> {
    frames.push(last);
    frames
}

fn run<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn messages_split_anywhere_across_frames_read_as_sent_and_a_clean_end_is_none() {
    let (a, b) = (response(3), response(300));
    let mut wire = framed(&a);
    wire.extend(framed(&b));
    // Frames of 1 byte (the prefix split too), 7, and one holding both.
    for piece in [1, 7, 4096, wire.len()] {
        let mut frames = data(&wire, piece);
        frames.push(trailers("0", ""));
        run(async {
            let mut r = Responses::of(http_response(&[], frames, false), 1 << 20).unwrap();
            assert_eq!(r.message().await.unwrap(), Some(Delta::from(a.clone())));
            assert_eq!(r.message().await.unwrap(), Some(Delta::from(b.clone())));
            assert_eq!(r.frames.len(), 0, "every frame freed once read past");
            assert_eq!(r.message().await.unwrap(), None);
        });
    }
}

#[test]
fn a_message_over_the_limit_is_refused_from_its_prefix_alone() {
    let wire = framed(&response(100));
    // Only the prefix arrives, and the body then waits: the refusal cannot
    // have waited for (or buffered) the message.
    let frames = data(&wire[..5], 5);
    let limit = wire.len() - 6;
    run(async {
        let mut r = Responses::of(http_response(&[], frames, true), limit).unwrap();
        let e = r.message().await.unwrap_err();
        assert_eq!(e.code(), Code::OutOfRange);
        assert!(e.message().contains("length too large"), "{e}");
        assert!(e.message().contains(&limit.to_string()), "{e}");
    });
}

#[test]
fn compressed_or_truncated_messages_and_error_statuses_end_the_stream() {
    let wire = framed(&response(2));
    let mut compressed = wire.clone();
    compressed[0] = 1;
    let mut odd_flag = wire.clone();
    odd_flag[0] = 7;
    let mut cases: Vec<(Vec<Frame<Bytes>>, Code, &str)> = vec![
        (data(&compressed, 64), Code::Internal, "compressed"),
        (data(&odd_flag, 64), Code::Internal, "flag 7"),
        (data(&wire[..wire.len() - 1], 64), Code::Internal, "ended"),
        (
            vec![trailers("14", "going away")],
            Code::Unavailable,
            "going away",
        ),
        // Part of a message, then a clean status: the part is an error.
        (
            then(data(&wire[..wire.len() - 1], 64), trailers("0", "")),
            Code::Internal,
            "ended",
        ),
    ];
    // A body that is not a message: the decode error, not a panic.
    let mut garbage = vec![0u8, 0, 0, 0, 3];
    garbage.extend([0x0a, 0xff, 0xff]);
    cases.push((data(&garbage, 64), Code::Internal, "does not decode"));
    for (frames, code, words) in cases {
        run(async {
            let mut r = Responses::of(http_response(&[], frames, false), 1 << 20).unwrap();
            let e = r.message().await.unwrap_err();
            assert_eq!(e.code(), code, "{e}");
            assert!(e.message().contains(words), "{e}");
        });
    }
}

#[test]
fn trailers_without_a_status_after_whole_messages_end_the_stream_cleanly() {
    // As tonic reads them (and as ztunnel then counts the stream's end).
    let wire = framed(&response(1));
    let frames = then(data(&wire, 64), Frame::trailers(http::HeaderMap::new()));
    let mut r = Responses::of(http_response(&[], frames, false), 1 << 20).unwrap();
    assert_eq!(run(r.message()).unwrap(), Some(Delta::from(response(1))));
    assert_eq!(run(r.message()).unwrap(), None);
}

#[test]
fn a_status_in_the_headers_or_an_http_error_ends_the_stream_at_once() {
    let refused = http_response(
        &[("grpc-status", "7"), ("grpc-message", "no token")],
        vec![],
        false,
    );
    let e = Responses::of(refused, 1 << 20).err().unwrap();
    assert_eq!(
        (e.code(), e.message()),
        (Code::PermissionDenied, "no token")
    );

    let mut unavailable = http_response(&[], vec![], false);
    *unavailable.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
    let e = Responses::of(unavailable, 1 << 20).err().unwrap();
    assert_eq!(e.code(), Code::Unavailable);

    let compressed = http_response(&[("grpc-encoding", "gzip")], vec![], false);
    let e = Responses::of(compressed, 1 << 20).err().unwrap();
    assert_eq!(e.code(), Code::Unimplemented);

    // A clean status in the headers: a stream with no messages.
    let done = http_response(&[("grpc-status", "0")], vec![], true);
    let mut r = Responses::of(done, 1 << 20).unwrap();
    assert_eq!(run(r.message()).unwrap(), None);
}

#[test]
fn the_front_of_the_frames_reads_as_one_buffer_and_frees_what_it_passes() {
    let mut frames: VecDeque<Bytes> = [&b"abc"[..], b"de", b"fghij"]
        .into_iter()
        .map(Bytes::from_static)
        .collect();
    let mut head = [0u8; 4];
    Front::new(&mut frames, 4).peek(&mut head);
    assert_eq!(&head, b"abcd");
    assert_eq!(frames.len(), 3, "a peek takes nothing");
    let mut front = Front::new(&mut frames, 6);
    assert_eq!(front.chunk(), b"abc");
    front.advance(4);
    assert_eq!((front.remaining(), front.chunk()), (2, &b"e"[..]));
    front.advance(1);
    assert_eq!(front.chunk(), b"f", "no further than its length");
    front.advance(1);
    assert_eq!(front.remaining(), 0);
    assert_eq!(frames, [Bytes::from_static(b"ghij")]);
}

#[test]
fn tiny_frames_are_held_together_not_one_queue_slot_each() {
    let wire = framed(&response(2_000));
    assert!(wire.len() > 100_000);
    let mut r = Responses::of(http_response(&[], vec![], false), 1 << 20).unwrap();
    for b in &wire[..wire.len() - 1] {
        r.keep(Bytes::copy_from_slice(&[*b]));
    }
    assert!(r.take().unwrap().is_none(), "one byte short");
    assert!(
        r.frames.len() <= wire.len() / super::SMALL + 2,
        "{} slots for {} bytes",
        r.frames.len(),
        wire.len()
    );
    r.keep(Bytes::copy_from_slice(&wire[wire.len() - 1..]));
    assert_eq!(r.take().unwrap(), Some(Delta::from(response(2_000))));
    assert_eq!((r.frames.len(), r.tail.len(), r.buffered), (0, 0, 0));
}
