//! The delta ADS stream: opened over a gRPC channel, its responses read
//! off the HTTP/2 body as they arrive.
//!
//! tonic's `Streaming` copies each message into one buffer until the
//! whole message is in, decodes it, and keeps the buffer, grown to the
//! largest message yet, until the stream ends: a full push of a million
//! workloads is 300 MB encoded, held beside the decoded response and then
//! beside the state for as long as the stream lives. Here a message is the
//! body's frames as received (no copy), and decoding frees each frame once
//! read past, so what is held at any time is the encoded part not yet
//! decoded plus what was decoded from the rest.
//!
//! On the wire nothing changes: the same method, headers and framing as
//! the generated client (its request side is tonic's own encoder), the
//! same limit on a message's size, read from its 5-byte prefix before any
//! of it is buffered, and the same statuses for the ways a stream ends
//! but two, where tonic's were lenient: a stream that ends (cleanly or
//! not) part way into a message is an error, not a clean end that drops
//! the part; and a response whose HTTP status is not 200, with no gRPC
//! status in its headers, is refused at once with the status gRPC maps
//! it to, not read as gRPC frames first (it is an error page).

use std::collections::VecDeque;

use bytes::{Buf, Bytes};
use futures_util::{Stream, StreamExt};
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, TE};
use http_body_util::BodyExt;
use prost::Message;
use tonic::body::BoxBody;
use tonic::codec::{Codec, EncodeBody, ProstCodec};
use tonic::{Code, Status};

use super::delta::Delta;
use crate::proto::discovery::DeltaDiscoveryRequest;

const PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// A gRPC message's prefix: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

/// Frames smaller than this are copied together before they are queued: a
/// DATA frame may be one byte, and each kept apart would cost a queue
/// slot (and hold the connection's read buffer), so a peer sending tiny
/// frames could make what is held many times what it sent.
const SMALL: usize = 4096;

/// Opens `DeltaAggregatedResources` on `channel`, sending `requests` with
/// `headers` (authorization, cluster id), and returns its responses;
/// none larger than `limit` bytes is taken.
pub async fn open(
    channel: &mut tonic::transport::Channel,
    requests: impl Stream<Item = DeltaDiscoveryRequest> + Send + 'static,
    headers: Vec<(HeaderName, HeaderValue)>,
    limit: usize,
) -> Result<Responses, Status> {
    use tower::{Service, ServiceExt};
    let encoder = ProstCodec::<DeltaDiscoveryRequest, Delta>::default().encoder();
    let body = EncodeBody::new_client(encoder, requests.map(Ok), None, None);
    let mut req = http::Request::new(tonic::body::boxed(body));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = http::Uri::from_static(PATH);
    *req.version_mut() = http::Version::HTTP_2;
    let h = req.headers_mut();
    h.insert(TE, HeaderValue::from_static("trailers"));
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    for (name, value) in headers {
        h.insert(name, value);
    }
    req.extensions_mut().insert(tonic::GrpcMethod::new(
        "envoy.service.discovery.v3.AggregatedDiscoveryService",
        "DeltaAggregatedResources",
    ));
    let ready = channel
        .ready()
        .await
        .map_err(|e| Status::unknown(format!("Service was not ready: {e}")))?;
    let response = ready
        .call(req)
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    Responses::of(response, limit)
}

/// The responses of an open stream, read with [`Responses::message`].
pub struct Responses {
    body: BoxBody,
    /// Received and not yet decoded, in order; none empty.
    frames: VecDeque<Bytes>,
    /// Small frames received after `frames`, copied together.
    tail: bytes::BytesMut,
    /// The bytes in `frames` and `tail`.
    buffered: usize,
    limit: usize,
    /// The body ended (its trailers, or its end, were read).
    ended: bool,
    /// When the message being received began to arrive.
    arriving: Option<std::time::Instant>,
    /// How long the last message took to arrive.
    received_in: std::time::Duration,
}

impl Responses {
    /// The stream a response opens, or the status it ended with at once.
    // A `Status`, as tonic's stream yields: an error ends the stream.
    #[allow(clippy::result_large_err)]
    fn of(response: http::Response<BoxBody>, limit: usize) -> Result<Responses, Status> {
        let headers = response.headers();
        // Nothing asked for compression; a compressed stream is refused,
        // not guessed at.
        if let Some(encoding) = headers.get("grpc-encoding") {
            if encoding != "identity" {
                return Err(Status::unimplemented(format!(
                    "the control plane's responses are compressed ({encoding:?}), \
                     which this proxy did not ask for"
                )));
            }
        }
        // A status in the headers ends the stream before any message.
        let at_once = Status::from_header_map(headers);
        if let Some(status) = &at_once {
            if status.code() != Code::Ok {
                return Err(status.clone());
            }
        }
        if at_once.is_none() && response.status() != http::StatusCode::OK {
            return Err(from_http(response.status()));
        }
        Ok(Responses {
            body: response.into_body(),
            frames: VecDeque::new(),
            tail: bytes::BytesMut::new(),
            buffered: 0,
            limit,
            ended: at_once.is_some(),
            arriving: None,
            received_in: std::time::Duration::ZERO,
        })
    }

    /// The next response; `None` once the server ended the stream cleanly.
    pub async fn message(&mut self) -> Result<Option<Delta>, Status> {
        loop {
            if let Some(m) = self.take()? {
                return Ok(Some(m));
            }
            if self.ended {
                return match self.buffered {
                    0 => Ok(None),
                    n => Err(Status::internal(format!(
                        "the stream ended {n} bytes into a message"
                    ))),
                };
            }
            let Some(frame) = self.body.frame().await else {
                // No trailers: a clean end, as tonic reads a 200 with none.
                self.ended = true;
                continue;
            };
            match frame?.into_data() {
                Ok(data) => self.keep(data),
                Err(frame) => {
                    self.ended = true;
                    // Trailers with no grpc-status: a clean end too (tonic's
                    // reading of a 200, so that the stream's end is counted
                    // as ztunnel counts it).
                    let status = frame.trailers_ref().and_then(Status::from_header_map);
                    if let Some(s) = status.filter(|s| s.code() != Code::Ok) {
                        return Err(s);
                    }
                }
            }
        }
    }

    /// How long the last message took to arrive, from its first frame
    /// to its last (zero when it came whole with the one before it).
    pub fn received_in(&self) -> std::time::Duration {
        self.received_in
    }

    /// Queues a received frame: as it is, or (a small one) copied beside
    /// the small ones before it.
    fn keep(&mut self, data: Bytes) {
        self.buffered += data.len();
        if data.len() < SMALL {
            self.tail.extend_from_slice(&data);
            if self.tail.len() >= SMALL {
                self.flush();
            }
        } else {
            self.flush();
            self.frames.push_back(data);
        }
    }

    /// Moves the small frames' copy to the queue.
    fn flush(&mut self) {
        if !self.tail.is_empty() {
            self.frames.push_back(self.tail.split().freeze());
        }
    }

    /// A whole message off the front of the frames, decoded; `None` until
    /// it is all in. Its size is checked as soon as its prefix is.
    #[allow(clippy::result_large_err)]
    fn take(&mut self) -> Result<Option<Delta>, Status> {
        if self.buffered < PREFIX {
            return Ok(None);
        }
        if self.buffered - self.tail.len() < PREFIX {
            self.flush();
        }
        let mut prefix = [0u8; PREFIX];
        Front::new(&mut self.frames, PREFIX).peek(&mut prefix);
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        match prefix[0] {
            0 => {}
            1 => {
                return Err(Status::internal(
                    "a compressed message, and no compression was asked for",
                ))
            }
            f => {
                return Err(Status::internal(format!(
                    "a message with compression flag {f} (0 and 1 are valid)"
                )))
            }
        }
        if len > self.limit {
            // tonic's words, which `client::stream_error` recognizes.
            return Err(Status::out_of_range(format!(
                "Error, decoded message length too large: found {len} bytes, \
                 the limit is: {} bytes",
                self.limit
            )));
        }
        if self.buffered < PREFIX + len {
            self.arriving.get_or_insert_with(std::time::Instant::now);
            return Ok(None);
        }
        self.flush();
        self.received_in = self
            .arriving
            .take()
            .map(|t| t.elapsed())
            .unwrap_or_default();
        self.buffered -= PREFIX + len;
        let mut message = Front::new(&mut self.frames, PREFIX + len);
        message.advance(PREFIX);
        let decoded = Delta::decode(&mut message)
            .map_err(|e| Status::internal(format!("a response that does not decode: {e}")));
        // Whatever the decoder left (it reads all on success) goes too.
        let rest = message.remaining();
        message.advance(rest);
        decoded.map(Some)
    }
}

/// gRPC's mapping of an HTTP status with no gRPC status (as tonic maps it).
fn from_http(status: http::StatusCode) -> Status {
    use http::StatusCode as H;
    let code = match status {
        H::BAD_REQUEST => Code::Internal,
        H::UNAUTHORIZED => Code::Unauthenticated,
        H::FORBIDDEN => Code::PermissionDenied,
        H::NOT_FOUND => Code::Unimplemented,
        H::TOO_MANY_REQUESTS | H::BAD_GATEWAY | H::SERVICE_UNAVAILABLE | H::GATEWAY_TIMEOUT => {
            Code::Unavailable
        }
        _ => Code::Unknown,
    };
    Status::new(
        code,
        format!(
            "grpc-status header missing, mapped from HTTP status code {}",
            status.as_u16()
        ),
    )
}

/// The first `len` bytes of a queue of frames, read as one buffer: each
/// frame leaves the queue (and is freed) once read past.
struct Front<'a> {
    frames: &'a mut VecDeque<Bytes>,
    left: usize,
}

impl<'a> Front<'a> {
    /// `frames` must hold at least `len` bytes.
    fn new(frames: &'a mut VecDeque<Bytes>, len: usize) -> Front<'a> {
        debug_assert!(frames.iter().map(Bytes::len).sum::<usize>() >= len);
        Front { frames, left: len }
    }

    /// Copies the first `out.len()` bytes, reading nothing past.
    fn peek(&self, out: &mut [u8]) {
        let mut at = 0;
        for f in self.frames.iter() {
            let n = (out.len() - at).min(f.len());
            out[at..at + n].copy_from_slice(&f[..n]);
            at += n;
            if at == out.len() {
                return;
            }
        }
    }
}

impl Buf for Front<'_> {
    fn remaining(&self) -> usize {
        self.left
    }

    fn chunk(&self) -> &[u8] {
        match self.frames.front() {
            Some(f) => &f[..f.len().min(self.left)],
            None => &[],
        }
    }

    fn advance(&mut self, mut n: usize) {
        assert!(n <= self.left, "advanced past the message");
        self.left -= n;
        while n > 0 {
            let Some(front) = self.frames.front_mut() else {
                unreachable!("the frames hold the whole message")
            };
            if n < front.len() {
                front.advance(n);
                return;
            }
            n -= front.len();
            self.frames.pop_front();
        }
    }
}

#[cfg(test)]
mod tests;
