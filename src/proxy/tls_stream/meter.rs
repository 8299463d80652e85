//! What the record layer charges the task's cooperative budget for what it
//! hands to h2: HTTP/2 frames, counted by walking their 9-byte headers
//! through the plaintext as it is opened (across records, and past the
//! client's 24-byte preface on the server side). Parsing costs h2 about the
//! same for a frame of 5 bytes as for one of 16 KiB, so a budget charged
//! per frame bounds a flood of small frames (PRIORITY, PING, SETTINGS)
//! tightly while a bulk flow of DATA frames, a few per record, is charged
//! about what a socket read costs.

/// The client's connection preface, which comes before any frame.
const PREFACE_LEN: usize = 24;
/// An HTTP/2 frame header.
const HEADER_LEN: usize = 9;

/// Where the walk is in the stream of frames.
#[derive(Debug, Clone)]
pub(super) struct FrameMeter {
    /// Preface bytes still to come (server side only).
    preface_left: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// The next header's bytes seen so far, when it spans records.
    header: [u8; HEADER_LEN],
    header_seen: usize,
}

impl FrameMeter {
    /// A meter for the side that receives: a server first gets the preface.
    pub(super) fn new(server: bool) -> Self {
        FrameMeter {
            preface_left: if server { PREFACE_LEN } else { 0 },
            payload_left: 0,
            header: [0; HEADER_LEN],
            header_seen: 0,
        }
    }

    /// Frames whose headers end in `plain`, the next bytes of the stream.
    /// Bytes that are not HTTP/2 count as whatever frames they spell: a
    /// count no larger than `plain.len() / 9 + 1`, and h2 ends such a
    /// connection anyway.
    pub(super) fn count(&mut self, mut plain: &[u8]) -> usize {
        let mut frames = 0;
        while !plain.is_empty() {
            if self.preface_left > 0 {
                let n = self.preface_left.min(plain.len());
                self.preface_left -= n;
                plain = &plain[n..];
                continue;
            }
            if self.payload_left > 0 {
                let n = self.payload_left.min(plain.len());
                self.payload_left -= n;
                plain = &plain[n..];
                continue;
            }
            let n = (HEADER_LEN - self.header_seen).min(plain.len());
            self.header[self.header_seen..self.header_seen + n].copy_from_slice(&plain[..n]);
            self.header_seen += n;
            plain = &plain[n..];
            if self.header_seen == HEADER_LEN {
                frames += 1;
                self.header_seen = 0;
                let h = &self.header;
                self.payload_left =
                    (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            }
        }
        frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, payload: usize) -> Vec<u8> {
        let mut f = vec![
            (payload >> 16) as u8,
            (payload >> 8) as u8,
            payload as u8,
            kind,
            0,
            0,
            0,
            0,
            1,
        ];
        f.resize(HEADER_LEN + payload, 0xAB);
        f
    }

    #[test]
    fn frames_are_counted_by_their_headers_wherever_records_cut_them() {
        let mut stream = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        stream.extend(frame(4, 0)); // SETTINGS
        for _ in 0..100 {
            stream.extend(frame(2, 5)); // PRIORITY
        }
        stream.extend(frame(0, 16_384)); // DATA
        stream.extend(frame(6, 8)); // PING
        let whole = FrameMeter::new(true).count(&stream);
        assert_eq!(whole, 103);
        // Cut anywhere, in pieces of any size, the count is the same.
        for piece in [1, 2, 7, 9, 10, 13, 100, 16_384] {
            let mut m = FrameMeter::new(true);
            let counted: usize = stream.chunks(piece).map(|c| m.count(c)).sum();
            assert_eq!(counted, whole, "pieces of {piece}");
        }
        // A client receives no preface.
        assert_eq!(FrameMeter::new(false).count(&frame(0, 100)), 1);
        // A bulk flow: one frame per 16 KiB.
        let mut m = FrameMeter::new(false);
        let data: Vec<u8> = (0..64).flat_map(|_| frame(0, 16_384)).collect();
        assert_eq!(data.chunks(16_384).map(|c| m.count(c)).sum::<usize>(), 64);
    }

    #[test]
    fn garbage_counts_at_most_a_frame_per_header_length() {
        let junk = vec![0u8; 900];
        assert!(FrameMeter::new(false).count(&junk) <= 900 / HEADER_LEN + 1);
        let ones = vec![0xFFu8; 900];
        assert!(FrameMeter::new(true).count(&ones) <= 1);
    }
}
