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
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use serde::Deserialize;

/// Immutable shared text. Clones share it; equality, order and hash are
/// the text's.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Name(Arc<str>);

/// The texts that may be shared, and when to sweep next.
struct Table {
    texts: HashSet<Arc<str>, foldhash::fast::RandomState>,
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
            table.texts.retain(|t| Arc::strong_count(t) > 1);
            table.sweep_at = (table.texts.len() * 2).max(SWEEP_FLOOR);
        }
        let shared: Arc<str> = Arc::from(text);
        table.texts.insert(shared.clone());
        Name(shared)
    }
}

static EMPTY: LazyLock<Name> = LazyLock::new(|| Name(Arc::from("")));

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
        &self.0
    }

    /// The shared text itself, for maps keyed by `Arc<str>`.
    pub fn shared(&self) -> &Arc<str> {
        &self.0
    }

    /// How many texts the table holds now (swept or not).
    #[cfg(test)]
    fn interned() -> usize {
        TABLE.lock().unwrap_or_else(|e| e.into_inner()).texts.len()
    }
}

impl Default for Name {
    /// The empty text (one shared copy).
    fn default() -> Name {
        EMPTY.clone()
    }
}

impl Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// As `str`'s, so that a `Name` key is found by a `&str`.
impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state)
    }
}

/// Not interned: for texts that do not repeat.
impl From<String> for Name {
    fn from(s: String) -> Name {
        if s.is_empty() {
            return Name::default();
        }
        Name(Arc::from(s))
    }
}

/// Not interned.
impl From<&str> for Name {
    fn from(s: &str) -> Name {
        if s.is_empty() {
            return Name::default();
        }
        Name(Arc::from(s))
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        super::same_text(&self.0, other)
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        super::same_text(&self.0, other)
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        super::same_text(&self.0, other)
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        super::same_text(self, &other.0)
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        super::same_text(self, &other.0)
    }
}

impl PartialEq<Name> for String {
    fn eq(&self, other: &Name) -> bool {
        super::same_text(self, &other.0)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl serde::Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
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
        assert!(Arc::ptr_eq(a.shared(), b.shared()));
        assert_eq!(a, "istio-system-interned-test");
        assert_eq!(a, b);
        let c = Name::from("istio-system-interned-test");
        assert!(!Arc::ptr_eq(a.shared(), c.shared()), "From does not intern");
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
            assert!(Arc::ptr_eq(name.shared(), Name::intern(text).shared()));
        }
        assert_eq!(Name::interner().intern(""), Name::default());
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
        assert!(Arc::ptr_eq(
            kept[7].shared(),
            Name::intern("kept-7").shared()
        ));
    }
}
