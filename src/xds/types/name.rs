//! `Name`: the state's immutable, shared text, and the table that lets
//! equal texts share one allocation.
//!
//! A mesh of a million workloads repeats a few thousand namespaces, service
//! accounts, nodes and revisions a million times each. As `String`s each
//! repeat was an allocation of its own; as interned `Name`s each is a
//! pointer to one shared copy. Texts that do not repeat (uids, pod names)
//! are `Name`s too, not interned, so the state's maps share them as keys
//! instead of copying them.
//!
//! The table holds only what the state holds: when it has doubled since its
//! last sweep it lets go of the texts nobody else holds any more, so texts
//! that a hostile or churning control plane sends once cost nothing once
//! their resources are gone. It is locked only by the writers of the state
//! (xDS conversion, the local file), never by the data path.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::{LazyLock, Mutex, MutexGuard};

use arcstr::ArcStr;

use serde::Deserialize;

/// Immutable shared text. Clones share it; equality, order and hash are
/// the text's. One pointer wide (the text's length is kept with it on the
/// heap, not beside the pointer as an `Arc<str>` keeps it): a workload
/// holds about fifteen, and every index is keyed by one.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Name(ArcStr);

/// The texts that may be shared, and when to sweep next.
struct Table {
    texts: HashSet<ArcStr, foldhash::fast::RandomState>,
    sweep_at: usize,
}

/// The table never sweeps below this many texts.
const SWEEP_FLOOR: usize = 4096;

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(|| {
    Mutex::new(Table {
        texts: HashSet::default(),
        sweep_at: SWEEP_FLOOR,
    })
});

/// The intern table, locked: see [`Name::interner`].
pub struct Interner<'a> {
    table: MutexGuard<'a, Table>,
    /// The last few texts interned through this guard: a resource repeats
    /// some (a workload's name, canonical name and service account are
    /// often one text), and these are found without a probe of the table.
    recent: [Option<Name>; RECENT],
    next: usize,
}

const RECENT: usize = 8;

impl Interner<'_> {
    /// `text`, sharing the copy any other interned `Name` of it holds.
    pub fn intern(&mut self, text: &str) -> Name {
        if text.is_empty() {
            return Name::default();
        }
        if let Some(seen) = self.recent.iter().flatten().find(|n| n.as_str() == text) {
            return seen.clone();
        }
        let name = self.in_table(text);
        self.recent[self.next] = Some(name.clone());
        self.next = (self.next + 1) % RECENT;
        name
    }

    fn in_table(&mut self, text: &str) -> Name {
        let table = &mut *self.table;
        if let Some(shared) = table.texts.get(text) {
            return Name(shared.clone());
        }
        if table.texts.len() >= table.sweep_at {
            // Only the table holds a text whose count is 1, and nobody can
            // take it from the table without this lock: safe to let go.
            // (The recent texts are held here too, so they stay.)
            table
                .texts
                .retain(|t| ArcStr::strong_count(t).is_none_or(|n| n > 1));
            table.sweep_at = (table.texts.len() * 2).max(SWEEP_FLOOR);
        }
        let shared = ArcStr::from(text);
        table.texts.insert(shared.clone());
        Name(shared)
    }
}

impl Name {
    /// `text`, sharing the copy any other interned `Name` of it holds.
    pub fn intern(text: &str) -> Name {
        Name::interner().intern(text)
    }

    /// The table, held for several texts in a row (one resource's): one
    /// lock for all of them, not one each. Nothing else may intern while
    /// it is held on the same thread.
    pub fn interner() -> Interner<'static> {
        Interner {
            // A poisoned lock only means a panic elsewhere while it was
            // held; the set itself is always whole.
            table: TABLE.lock().unwrap_or_else(|e| e.into_inner()),
            recent: Default::default(),
            next: 0,
        }
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// Whether the two share one copy of their text.
    pub fn ptr_eq(&self, other: &Name) -> bool {
        ArcStr::ptr_eq(&self.0, &other.0)
    }

    /// How many texts the table holds now (swept or not).
    #[cfg(test)]
    fn interned() -> usize {
        TABLE.lock().unwrap_or_else(|e| e.into_inner()).texts.len()
    }
}

impl Default for Name {
    /// The empty text (no allocation).
    fn default() -> Name {
        Name(ArcStr::new())
    }
}

impl Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        self.0.as_str()
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        self.0.as_str()
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        self.0.as_str()
    }
}

/// As `str`'s, so that a `Name` key is found by a `&str`.
impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

/// Not interned: for texts that do not repeat.
impl From<String> for Name {
    fn from(s: String) -> Name {
        if s.is_empty() {
            return Name::default();
        }
        Name(ArcStr::from(s))
    }
}

/// Not interned.
impl From<&str> for Name {
    fn from(s: &str) -> Name {
        if s.is_empty() {
            return Name::default();
        }
        Name(ArcStr::from(s))
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        super::same_text(self.as_str(), other)
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        super::same_text(self.as_str(), other)
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        super::same_text(self.as_str(), other)
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        super::same_text(self, other.as_str())
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        super::same_text(self, other.as_str())
    }
}

impl PartialEq<Name> for String {
    fn eq(&self, other: &Name) -> bool {
        super::same_text(self, other.as_str())
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl serde::Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Interned: a file repeats its namespaces as a control plane does.
impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(Name::intern(&text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interned_names_share_one_copy_and_compare_as_text() {
        let a = Name::intern("istio-system-interned-test");
        let b = Name::intern(&String::from("istio-system-interned-test"));
        assert!(a.ptr_eq(&b));
        assert_eq!(a, "istio-system-interned-test");
        assert_eq!(a, b);
        let c = Name::from("istio-system-interned-test");
        assert!(!a.ptr_eq(&c), "From does not intern");
        assert_eq!(a, c);
        assert_eq!(Name::intern(""), Name::default());
        assert!(Name::default().is_empty());
    }

    #[test]
    fn one_lock_for_many_texts_shares_them_as_one_call_each_would() {
        let texts: Vec<String> = (0..3 * RECENT)
            .map(|i| format!("held-together-{}", i % (RECENT + 3)))
            .collect();
        let names: Vec<Name> = {
            let mut table = Name::interner();
            texts.iter().map(|t| table.intern(t)).collect()
        };
        for (text, name) in texts.iter().zip(&names) {
            assert_eq!(name, text);
            assert!(name.ptr_eq(&Name::intern(text)));
        }
        assert_eq!(Name::interner().intern(""), Name::default());
    }

    #[test]
    fn a_name_is_one_pointer_wide() {
        assert_eq!(std::mem::size_of::<Name>(), std::mem::size_of::<usize>());
        assert_eq!(
            std::mem::size_of::<Option<Name>>(),
            std::mem::size_of::<usize>()
        );
    }

    #[test]
    fn texts_nobody_holds_are_let_go() {
        // Ten floors' worth of distinct texts, each dropped at once: swept,
        // the table stays near the floor (other tests hold a few too).
        let kept: Vec<Name> = (0..100)
            .map(|i| Name::intern(&format!("kept-{i}")))
            .collect();
        for i in 0..10 * SWEEP_FLOOR {
            drop(Name::intern(&format!("churn-{i}")));
        }
        assert!(
            Name::interned() < 4 * SWEEP_FLOOR,
            "{} texts held",
            Name::interned()
        );
        // What is still held is still shared.
        assert!(kept[7].ptr_eq(&Name::intern("kept-7")));
    }
}
