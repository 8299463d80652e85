//! The bytes of a CRL file (`CRL_PATH`) through `CrlSet::parse`, as the
//! proxy reads it at start and at each change.
//!
//! Checked beyond "no panic": a blank file is no list; a file parses to no
//! more lists than it has CRL blocks (PEM) or one (DER); and parsing the
//! same bytes twice gives the same answer.

#![no_main]

use ambit::identity::crl::CrlSet;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let first = CrlSet::parse(bytes);
    if bytes.iter().all(u8::is_ascii_whitespace) {
        assert!(first.as_ref().is_ok_and(|s| s.is_empty()));
    }
    if let Ok(set) = &first {
        let blocks = bytes
            .windows(b"-----BEGIN X509 CRL-----".len())
            .filter(|w| *w == b"-----BEGIN X509 CRL-----")
            .count();
        assert!(set.len() <= blocks.max(1));
    }
    let again = CrlSet::parse(bytes);
    assert_eq!(
        first.map(|s| (s.len(), s.revoked)),
        again.map(|s| (s.len(), s.revoked))
    );
});
