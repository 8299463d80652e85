//! A delta xDS response as the client decodes it: its resources in
//! chunks rather than one list.
//!
//! A full push of a large mesh is a million resources. Decoded into one
//! `Vec` (as prost's `DeltaDiscoveryResponse` does) their 120-byte headers
//! are one allocation of up to twice their size (the list grows by
//! doubling), held until the last of them is applied. Here they are
//! decoded into chunks of [`CHUNK`], and a chunk is freed as soon as its
//! resources are taken, so the state built from them reuses its memory.
//! On the wire it is the same message: every field is read and written
//! as `envoy.service.discovery.v3.DeltaDiscoveryResponse`'s (fields this
//! proxy does not use are skipped, as prost skips unknown ones).

use prost::bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;

use crate::proto::discovery::{DeltaDiscoveryResponse, Resource};

/// Resources per chunk.
const CHUNK: usize = 256;

/// `DeltaDiscoveryResponse` with its resources in chunks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub system_version_info: String,
    pub resources: Chunked<Resource>,
    pub type_url: String,
    pub nonce: String,
    pub removed_resources: Vec<String>,
}

impl From<DeltaDiscoveryResponse> for Delta {
    fn from(r: DeltaDiscoveryResponse) -> Delta {
        Delta {
            system_version_info: r.system_version_info,
            resources: r.resources.into_iter().collect(),
            type_url: r.type_url,
            nonce: r.nonce,
            removed_resources: r.removed_resources,
        }
    }
}

impl prost::Message for Delta {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.system_version_info.is_empty() {
            encoding::string::encode(1, &self.system_version_info, buf);
        }
        for r in self.resources.iter() {
            encoding::message::encode(2, r, buf);
        }
        if !self.type_url.is_empty() {
            encoding::string::encode(4, &self.type_url, buf);
        }
        if !self.nonce.is_empty() {
            encoding::string::encode(5, &self.nonce, buf);
        }
        encoding::string::encode_repeated(6, &self.removed_resources, buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => encoding::string::merge(wire_type, &mut self.system_version_info, buf, ctx),
            2 => {
                let mut r = Resource::default();
                encoding::message::merge(wire_type, &mut r, buf, ctx)?;
                self.resources.push(r);
                Ok(())
            }
            4 => encoding::string::merge(wire_type, &mut self.type_url, buf, ctx),
            5 => encoding::string::merge(wire_type, &mut self.nonce, buf, ctx),
            6 => encoding::string::merge_repeated(wire_type, &mut self.removed_resources, buf, ctx),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let text = |tag, s: &String| match s.is_empty() {
            true => 0,
            false => encoding::string::encoded_len(tag, s),
        };
        text(1, &self.system_version_info)
            + self
                .resources
                .iter()
                .map(|r| encoding::message::encoded_len(2, r))
                .sum::<usize>()
            + text(4, &self.type_url)
            + text(5, &self.nonce)
            + encoding::string::encoded_len_repeated(6, &self.removed_resources)
    }

    fn clear(&mut self) {
        *self = Delta::default();
    }
}

/// A list kept in chunks of [`CHUNK`]; taken by value, each chunk goes
/// once its items are taken. Equal when its items are.
#[derive(Debug, Clone)]
pub struct Chunked<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Chunked {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T: PartialEq> PartialEq for Chunked<T> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl<T> Chunked<T> {
    pub fn push(&mut self, item: T) {
        match self.chunks.last_mut() {
            Some(last) if last.len() < CHUNK => last.push(item),
            _ => {
                // The first chunk grows as items come (an update is one
                // resource, not 256 slots); the next ones are whole.
                let mut chunk = match self.chunks.is_empty() {
                    true => Vec::new(),
                    false => Vec::with_capacity(CHUNK),
                };
                chunk.push(item);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

impl<T> FromIterator<T> for Chunked<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Self {
        let mut chunked = Chunked::default();
        items.into_iter().for_each(|i| chunked.push(i));
        chunked
    }
}

impl<T> IntoIterator for Chunked<T> {
    type Item = T;
    type IntoIter = IntoIter<T>;

    fn into_iter(self) -> IntoIter<T> {
        IntoIter {
            chunks: self.chunks.into_iter(),
            current: Vec::new().into_iter(),
            left: self.len,
        }
    }
}

/// The items of a [`Chunked`] by value, in order; a chunk is freed when
/// its last item is taken.
pub struct IntoIter<T> {
    chunks: std::vec::IntoIter<Vec<T>>,
    current: std::vec::IntoIter<T>,
    left: usize,
}

impl<T> Iterator for IntoIter<T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        loop {
            if let Some(item) = self.current.next() {
                self.left -= 1;
                return Some(item);
            }
            // The spent chunk's allocation goes here.
            self.current = self.chunks.next()?.into_iter();
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<T> ExactSizeIterator for IntoIter<T> {}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    fn resource(i: usize) -> Resource {
        Resource {
            name: format!("ns/r{i}"),
            version: format!("{i}"),
            aliases: vec![format!("alias-{i}")],
            resource: Some(prost_types::Any {
                type_url: "type.googleapis.com/istio.workload.Address".into(),
                value: vec![i as u8; i % 7],
            }),
        }
    }

    #[test]
    fn reads_and_writes_what_prosts_delta_response_does() {
        for n in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] {
            let plain = DeltaDiscoveryResponse {
                system_version_info: "v9".into(),
                resources: (0..n).map(resource).collect(),
                type_url: "type.googleapis.com/istio.workload.Address".into(),
                nonce: format!("nonce-{n}"),
                removed_resources: vec!["ns/gone".into(), "ns/gone-too".into()],
            };
            let wire = plain.encode_to_vec();
            let delta = Delta::decode(wire.as_slice()).expect("decodes");
            assert_eq!(delta, Delta::from(plain.clone()), "{n} resources");
            assert_eq!(delta.resources.len(), n);
            assert_eq!(delta.encoded_len(), wire.len());
            assert_eq!(delta.encode_to_vec(), wire, "{n} resources written back");
            let back: Vec<Resource> = delta.resources.into_iter().collect();
            assert_eq!(back, plain.resources);
        }
    }

    #[test]
    fn fields_it_does_not_use_are_skipped_and_bad_input_is_an_error() {
        let plain = DeltaDiscoveryResponse {
            type_url: "t".into(),
            resources: vec![resource(3)],
            ..Default::default()
        };
        let mut wire = plain.encode_to_vec();
        // Field 7 (the control plane's identifier), a message.
        wire.extend_from_slice(&[0x3a, 0x02, 0x0a, 0x00]);
        let delta = Delta::decode(wire.as_slice()).expect("decodes");
        assert_eq!(delta, Delta::from(plain));
        // A resource whose length runs past the end.
        assert!(Delta::decode(&[0x12, 0x40, 0x0a][..]).is_err());
    }

    #[test]
    fn a_chunk_holds_no_more_room_than_its_items_need() {
        let one: Chunked<Resource> = std::iter::once(resource(1)).collect();
        assert!(
            one.chunks[0].capacity() < 8,
            "one resource, room for {}",
            one.chunks[0].capacity()
        );
        let many: Chunked<u8> = (0..3 * CHUNK).map(|i| i as u8).collect();
        assert!(many.chunks.iter().all(|c| c.capacity() == CHUNK));
    }

    #[test]
    fn taken_by_value_each_chunk_goes_once_its_items_are_taken() {
        let items: Chunked<usize> = (0..3 * CHUNK).collect();
        let mut it = items.into_iter();
        assert_eq!(it.len(), 3 * CHUNK);
        assert_eq!(
            it.by_ref().take(CHUNK + 1).collect::<Vec<_>>(),
            (0..=CHUNK).collect::<Vec<_>>()
        );
        // The first chunk is gone: the second is being taken, the third
        // is the one left whole.
        assert_eq!(it.chunks.len(), 1);
        assert_eq!(it.len(), 2 * CHUNK - 1);
        assert_eq!(
            it.collect::<Vec<_>>(),
            (CHUNK + 1..3 * CHUNK).collect::<Vec<_>>()
        );
    }
}
