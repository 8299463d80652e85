//! Gives back the pages of the binary (and its libraries) that only start-up
//! ran. A process maps the executable's code and read-only data from the
//! page cache as it runs, and the kernel maps 64 KiB around every page it
//! faults in; config parsing, certificate generation and the CLI leave about
//! half the binary's code in the resident set for the process's life
//! (measured: 6.5 of 13.3 MB of text in a dedicated proxy). Unmapping the
//! clean file pages once start-up is over leaves only what runs afterwards,
//! which maps back on its first use. Owns no policy: callers say when.
//!
//! Safe by construction: only private, non-writable mappings of a file that
//! hold no anonymous (copied-on-write) page are unmapped. Their pages are
//! exactly the file's, so `MADV_DONTNEED` loses nothing; the pages stay in
//! the page cache. Relocated data (RELRO) has anonymous pages and is kept.

use std::io;
use std::ops::Range;

/// One mapping of `/proc/self/smaps` that may be unmapped, and its resident
/// size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Releasable {
    pub addrs: Range<usize>,
    pub resident_kb: u64,
}

/// The mappings of `smaps` whose pages are clean copies of a file: private,
/// not writable, backed by a path, no anonymous pages, some resident.
pub fn releasable(smaps: &str) -> Vec<Releasable> {
    let mut out = Vec::new();
    let mut current: Option<(Range<usize>, bool)> = None;
    let mut rss = 0;
    let mut anonymous = 0;
    let mut flush = |current: &mut Option<(Range<usize>, bool)>, rss: u64, anonymous: u64| {
        if let Some((addrs, clean_file)) = current.take() {
            if clean_file && anonymous == 0 && rss > 0 {
                out.push(Releasable {
                    addrs,
                    resident_kb: rss,
                });
            }
        }
    };
    for line in smaps.lines() {
        if let Some((addrs, clean_file)) = mapping_header(line) {
            flush(&mut current, rss, anonymous);
            current = Some((addrs, clean_file));
            rss = 0;
            anonymous = 0;
        } else if let Some(kb) = field_kb(line, "Rss:") {
            rss = kb;
        } else if let Some(kb) = field_kb(line, "Anonymous:") {
            anonymous = kb;
        }
    }
    flush(&mut current, rss, anonymous);
    out
}

/// A mapping's header line (`start-end perms offset dev inode path`): its
/// addresses, and whether it is a private, non-writable mapping of a path.
fn mapping_header(line: &str) -> Option<(Range<usize>, bool)> {
    let mut fields = line.split_ascii_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?.as_bytes();
    if perms.len() != 4 || start >= end {
        return None;
    }
    let path = fields.nth(3).unwrap_or("");
    let clean_file = perms[1] == b'-' && perms[3] == b'p' && path.starts_with('/');
    Some((start..end, clean_file))
}

fn field_kb(line: &str, key: &str) -> Option<u64> {
    let rest = line.strip_prefix(key)?.trim();
    rest.strip_suffix("kB")?.trim().parse().ok()
}

/// Set, [`release_file_pages`] also cuts each mapping it releases into
/// one mapping per page, so that the kernel's fault-around stops at every
/// page and `/proc/<pid>/smaps` shows exactly the pages that ran since.
/// A profiling aid for `benches/hot-functions.py`, which orders the link
/// by what a proxy runs; it costs a page fault per page of code.
pub const TRACE_PAGES_ENV: &str = "AMBIT_TRACE_CODE_PAGES";

/// Unmaps every [`releasable`] mapping of this process; returns the
/// resident kB given back. A mapping the kernel refuses (locked) is kept.
pub fn release_file_pages() -> io::Result<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let trace = std::env::var_os(TRACE_PAGES_ENV).is_some();
    let mut released = 0;
    for m in releasable(&smaps) {
        // SAFETY: the range is a whole mapping of this process whose pages
        // are unmodified file pages (no anonymous page, not writable), so
        // dropping them changes no byte the process can read: the next
        // access maps the same file page again.
        let rc = unsafe {
            libc::madvise(
                m.addrs.start as *mut libc::c_void,
                m.addrs.end - m.addrs.start,
                libc::MADV_DONTNEED,
            )
        };
        if rc == 0 {
            released += m.resident_kb;
        }
        if trace {
            one_mapping_per_page(&m.addrs);
        }
    }
    Ok(released)
}

/// Marks every other page of `addrs` for random access: neighbouring pages
/// then differ in their flags, so the kernel keeps each one its own
/// mapping. Only the read-ahead hint changes.
fn one_mapping_per_page(addrs: &Range<usize>) {
    const PAGE: usize = 4096;
    for page in addrs.clone().step_by(2 * PAGE) {
        // SAFETY: MADV_RANDOM on pages of this process's own mapping only
        // changes the kernel's read-ahead for them.
        unsafe { libc::madvise(page as *mut libc::c_void, PAGE, libc::MADV_RANDOM) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55ed6f06d000-55ed6f39c000 r--p 00000000 fe:00 5365814                    /usr/bin/ambit
Size:               3260 kB
Rss:                1676 kB
Anonymous:             0 kB
55ed6f39c000-55ed70042000 r-xp 0032e000 fe:00 5365814                    /usr/bin/ambit
Size:              13080 kB
Rss:                6536 kB
Anonymous:             0 kB
55ed70042000-55ed700a7000 r--p 00fd3000 fe:00 5365814                    /usr/bin/ambit
Size:                404 kB
Rss:                 404 kB
Anonymous:           404 kB
55ed700a7000-55ed700aa000 rw-p 01037000 fe:00 5365814                    /usr/bin/ambit
Rss:                  12 kB
Anonymous:            12 kB
55ed80a3a000-55ed80a89000 rw-p 00000000 00:00 0                          [heap]
Rss:                 296 kB
Anonymous:           296 kB
7efd3ab81000-7efd3acd7000 r-xp 00026000 fe:00 326279                     /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 892 kB
Anonymous:             0 kB
7efd3acd8000-7efd3acd9000 r--s 00000000 fe:00 1000                       /dev/shm/shared
Rss:                   4 kB
Anonymous:             0 kB
7efd3acd9000-7efd3acda000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   4 kB
Anonymous:             0 kB
7efd3acda000-7efd3acdb000 r-xp 00000000 fe:00 1001                       /opt/not resident
Rss:                   0 kB
Anonymous:             0 kB
";

    #[test]
    fn only_clean_private_file_pages_are_released() {
        let got = releasable(SMAPS);
        let starts: Vec<usize> = got.iter().map(|m| m.addrs.start).collect();
        assert_eq!(
            starts,
            vec![0x55ed6f06d000, 0x55ed6f39c000, 0x7efd3ab81000],
            "read-only data, code and the library's code; not RELRO (copied pages), \
             data, heap, shared or anonymous mappings, nor what holds nothing"
        );
        assert_eq!(
            got.iter().map(|m| m.resident_kb).sum::<u64>(),
            1676 + 6536 + 892
        );
    }

    #[test]
    fn a_mapping_with_a_copied_page_is_kept_even_if_read_only_now() {
        let smaps = "\
1000-3000 r-xp 00000000 fe:00 1 /bin/x
Rss:                   8 kB
Anonymous:             4 kB
";
        assert!(releasable(smaps).is_empty());
    }

    #[test]
    fn lines_that_are_not_smaps_are_ignored() {
        assert!(releasable("garbage\nRss: lots\nzz-yy r-xp 0 0 0 /x\n").is_empty());
    }

    #[test]
    fn tracing_cuts_a_mapping_into_one_per_page() {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open("/proc/self/exe").expect("own binary");
        let len = 8 * 4096;
        // SAFETY: a fresh read-only private mapping of a file we hold open;
        // unmapped below, never dereferenced.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let start = base as usize;
        one_mapping_per_page(&(start..start + len));
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let pieces = maps
            .lines()
            .filter_map(mapping_header)
            .filter(|(r, _)| r.start >= start && r.end <= start + len)
            .count();
        // SAFETY: the mapping made above, of that length.
        unsafe { libc::munmap(base, len) };
        assert_eq!(pieces, 8, "one mapping per page of the 8");
    }

    #[test]
    fn releasing_keeps_the_code_running() {
        // After the process's own code and read-only data are unmapped, it
        // still computes the same (they map back on use), and the relocated
        // data it reads through a vtable is intact.
        let released = release_file_pages().expect("own smaps readable");
        assert!(released > 0, "the test binary's code was resident");
        let boxed: Box<dyn Fn(u64) -> u64> = Box::new(|x| x * 3);
        assert_eq!(boxed(14), 42);
    }
}
