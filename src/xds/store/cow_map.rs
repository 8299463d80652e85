//! `CowMap`: the state's persistent hash map, a trie of small hash tables
//! copied on write.
//!
//! The state is copied for every change and the copy swapped in whole
//! (`store.rs`), so each of its maps must copy in O(1) and change in time
//! that does not grow with its size. imbl's hash array mapped trie did
//! that, but at a million entries its nodes cost five times the entries
//! they hold (32-slot nodes, mostly empty at the bottom): about 160 bytes
//! an entry of 32, in each of the five maps a workload is in.
//!
//! Here the entries live in leaves that are hashbrown tables of up to
//! [`LEAF_MAX`] entries (open addressing: one control byte an entry, more
//! than half full), under branches of eight children picked by three bits
//! of the key's hash at each level. A copy shares the root; a change copies
//! the path to its leaf (a branch is eight pointers) and the leaf, so it
//! touches about a hundred reference counts at a million entries. A leaf
//! past [`LEAF_MAX`] becomes a branch of eight leaves; an emptied leaf, and
//! a branch left with no child, go.
//!
//! The trie's bits start at bit 8 of the hash: the tables' bucket index
//! uses the low bits and their control byte the top seven.

use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use hashbrown::{Equivalent, HashTable};

type Hasher = foldhash::fast::RandomState;

/// A persistent hash map: clones share all of it; a change copies the path
/// to the leaf it touches.
pub struct CowMap<K, V> {
    hasher: Hasher,
    len: usize,
    root: Option<Arc<Node<K, V>>>,
}

#[derive(Clone)]
enum Node<K, V> {
    Leaf(HashTable<(K, V)>),
    Branch([Option<Arc<Node<K, V>>>; FANOUT]),
}

const FANOUT_BITS: u32 = 3;
const FANOUT: usize = 1 << FANOUT_BITS;
/// A leaf holding more becomes a branch (a table of 128 buckets holds 112).
const LEAF_MAX: usize = 112;
/// The first hash bit the trie uses.
const FIRST_BIT: u32 = 8;
/// Below this depth the trie's bits would reach the control byte's: a
/// leaf there grows without splitting.
const MAX_DEPTH: u32 = (57 - FIRST_BIT) / FANOUT_BITS;

/// The child of `hash` at `depth`.
fn child(hash: u64, depth: u32) -> usize {
    ((hash >> (FIRST_BIT + depth * FANOUT_BITS)) as usize) & (FANOUT - 1)
}

impl<K, V> Default for CowMap<K, V> {
    fn default() -> Self {
        CowMap {
            hasher: Hasher::default(),
            len: 0,
            root: None,
        }
    }
}

impl<K, V> Clone for CowMap<K, V> {
    fn clone(&self) -> Self {
        CowMap {
            hasher: self.hasher.clone(),
            len: self.len,
            root: self.root.clone(),
        }
    }
}

impl<K: fmt::Debug, V: fmt::Debug> fmt::Debug for CowMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K, V> CowMap<K, V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> Iter<'_, K, V> {
        Iter {
            stack: self.root.as_deref().into_iter().collect(),
            leaf: None,
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }
}

impl<K: Hash + Eq + Clone, V: Clone> CowMap<K, V> {
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        Q: Hash + Equivalent<K> + ?Sized,
    {
        self.get_hashed(self.hasher.hash_one(key), key)
    }

    fn get_hashed<Q>(&self, hash: u64, key: &Q) -> Option<&V>
    where
        Q: Equivalent<K> + ?Sized,
    {
        let mut node = self.root.as_deref()?;
        let mut depth = 0;
        loop {
            match node {
                Node::Leaf(table) => {
                    return table.find(hash, |(k, _)| key.equivalent(k)).map(|(_, v)| v)
                }
                Node::Branch(children) => node = children[child(hash, depth)].as_deref()?,
            }
            depth += 1;
        }
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        Q: Hash + Equivalent<K> + ?Sized,
    {
        self.get(key).is_some()
    }

    /// The value of `key`, its path copied first where shared (nothing is
    /// copied when the key is absent).
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        Q: Hash + Equivalent<K> + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        self.get_hashed(hash, key)?;
        self.get_mut_hashed(hash, key)
    }

    /// The value of `key`, with `make`'s key and value put there first if
    /// it has none; and whether they were. Its path is copied where shared.
    /// `make`'s key must be `key`'s text (the same hash).
    pub fn get_or_insert_with<Q>(
        &mut self,
        key: &Q,
        make: impl FnOnce() -> (K, V),
    ) -> (&mut V, bool)
    where
        Q: Hash + Equivalent<K> + ?Sized,
    {
        // A walk that only reads, then the walks that copy: one walk that
        // copied as it went (`make_mut`, an atomic change of each node's
        // count, on nodes not yet in the cache) measured slower
        // (docs/perf-log.md, 2026-12-06).
        let hash = self.hasher.hash_one(key);
        let inserted = self.get_hashed(hash, key).is_none();
        if inserted {
            let (k, v) = make();
            self.insert_hashed(hash, k, v);
        }
        let value = self.get_mut_hashed(hash, key).expect("held or just put");
        (value, inserted)
    }

    /// Walks to `key`'s leaf copying the path where shared.
    fn get_mut_hashed<Q>(&mut self, hash: u64, key: &Q) -> Option<&mut V>
    where
        Q: Equivalent<K> + ?Sized,
    {
        let mut node = Arc::make_mut(self.root.as_mut()?);
        let mut depth = 0;
        loop {
            match node {
                Node::Leaf(table) => {
                    return table
                        .find_mut(hash, |(k, _)| key.equivalent(k))
                        .map(|(_, v)| v)
                }
                Node::Branch(children) => {
                    node = Arc::make_mut(children[child(hash, depth)].as_mut()?)
                }
            }
            depth += 1;
        }
    }

    /// Puts `value` at `key` (this `key`, in place of an equal one held);
    /// the value it replaces, if any.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let hash = self.hasher.hash_one(&key);
        self.insert_hashed(hash, key, value)
    }

    fn insert_hashed(&mut self, hash: u64, key: K, value: V) -> Option<V> {
        let root = self
            .root
            .get_or_insert_with(|| Arc::new(Node::Leaf(HashTable::new())));
        let replaced = insert(root, 0, hash, key, value, &self.hasher);
        if replaced.is_none() {
            self.len += 1;
        }
        replaced
    }

    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        Q: Hash + Equivalent<K> + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        self.get_hashed(hash, key)?;
        let slot = &mut self.root;
        let removed = remove(slot, 0, hash, key);
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }
}

fn insert<K: Hash + Eq + Clone, V: Clone>(
    node: &mut Arc<Node<K, V>>,
    depth: u32,
    hash: u64,
    key: K,
    value: V,
    hasher: &Hasher,
) -> Option<V> {
    match Arc::make_mut(node) {
        Node::Branch(children) => {
            let slot = children[child(hash, depth)]
                .get_or_insert_with(|| Arc::new(Node::Leaf(HashTable::new())));
            insert(slot, depth + 1, hash, key, value, hasher)
        }
        Node::Leaf(table) => {
            if let Some(entry) = table.find_mut(hash, |(k, _)| *k == key) {
                // The key too: an equal text, but the caller may share
                // this copy with another map (one allocation for both).
                return Some(std::mem::replace(entry, (key, value)).1);
            }
            table.insert_unique(hash, (key, value), |(k, _)| hasher.hash_one(k));
            if table.len() > LEAF_MAX && depth < MAX_DEPTH {
                let full = std::mem::take(table);
                *Arc::make_mut(node) = split(full, depth, hasher);
            }
            None
        }
    }
}

/// A leaf's entries, spread over a branch of leaves.
fn split<K: Hash, V>(mut full: HashTable<(K, V)>, depth: u32, hasher: &Hasher) -> Node<K, V> {
    let mut leaves: [HashTable<(K, V)>; FANOUT] = Default::default();
    for entry in full.drain() {
        let hash = hasher.hash_one(&entry.0);
        leaves[child(hash, depth)].insert_unique(hash, entry, |(k, _)| hasher.hash_one(k));
    }
    Node::Branch(leaves.map(|t| (!t.is_empty()).then(|| Arc::new(Node::Leaf(t)))))
}

/// Removes `key` below `slot`; an emptied leaf or branch leaves its slot
/// empty.
fn remove<K, V: Clone, Q>(
    slot: &mut Option<Arc<Node<K, V>>>,
    depth: u32,
    hash: u64,
    key: &Q,
) -> Option<V>
where
    K: Hash + Eq + Clone,
    Q: Hash + Equivalent<K> + ?Sized,
{
    let node = Arc::make_mut(slot.as_mut()?);
    let (removed, empty) = match node {
        Node::Branch(children) => {
            let removed = remove(&mut children[child(hash, depth)], depth + 1, hash, key);
            (removed, children.iter().all(Option::is_none))
        }
        Node::Leaf(table) => {
            let removed = table
                .find_entry(hash, |(k, _)| key.equivalent(k))
                .ok()
                .map(|e| e.remove().0 .1);
            (removed, table.is_empty())
        }
    };
    if empty {
        *slot = None;
    }
    removed
}

/// The entries, leaf by leaf.
pub struct Iter<'a, K, V> {
    stack: Vec<&'a Node<K, V>>,
    leaf: Option<hashbrown::hash_table::Iter<'a, (K, V)>>,
}

impl<'a, K, V> Iterator for Iter<'a, K, V> {
    type Item = (&'a K, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((k, v)) = self.leaf.as_mut().and_then(Iterator::next) {
                return Some((k, v));
            }
            match self.stack.pop()? {
                Node::Leaf(table) => self.leaf = Some(table.iter()),
                Node::Branch(children) => {
                    self.stack.extend(children.iter().flatten().map(|c| &**c))
                }
            }
        }
    }
}

impl<'a, K, V> IntoIterator for &'a CowMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Iter<'a, K, V>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Every operation against std's map, across the splits, with old
    /// copies kept and checked unchanged.
    #[test]
    fn behaves_as_a_map_and_a_copy_never_sees_a_later_change() {
        type Pair = (CowMap<Arc<str>, u64>, HashMap<String, u64>);
        let mut map: CowMap<Arc<str>, u64> = CowMap::default();
        let mut model: HashMap<String, u64> = HashMap::new();
        let mut copies: Vec<Pair> = Vec::new();
        let mut seed = 7u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for step in 0..40_000u64 {
            let key = format!("k{}", next() % 12_000);
            match next() % 10 {
                0..=5 => assert_eq!(
                    map.insert(Arc::from(key.as_str()), step),
                    model.insert(key, step)
                ),
                6 | 7 => assert_eq!(map.remove(key.as_str()), model.remove(&key)),
                8 => {
                    if let Some(v) = map.get_mut(key.as_str()) {
                        *v += 1;
                    }
                    if let Some(v) = model.get_mut(&key) {
                        *v += 1;
                    }
                }
                9 if step % 2 == 0 => {
                    let (v, new) =
                        map.get_or_insert_with(key.as_str(), || (Arc::from(key.as_str()), step));
                    *v += 1;
                    let absent = !model.contains_key(&key);
                    *model.entry(key).or_insert(step) += 1;
                    assert_eq!(new, absent);
                }
                _ => assert_eq!(map.get(key.as_str()), model.get(&key)),
            }
            assert_eq!(map.len(), model.len());
            if step % 5_000 == 0 {
                copies.push((map.clone(), model.clone()));
            }
        }
        assert!(
            matches!(map.root.as_deref(), Some(Node::Branch(_))),
            "the map split its leaves"
        );
        copies.push((map.clone(), model.clone()));
        for (copy, model) in &copies {
            assert_eq!(copy.len(), model.len());
            let mut seen: HashMap<String, u64> = HashMap::new();
            for (k, v) in copy {
                assert!(seen.insert(k.to_string(), *v).is_none(), "{k} twice");
            }
            assert_eq!(&seen, model);
            for (k, v) in model {
                assert_eq!(copy.get(k.as_str()), Some(v));
            }
            assert!(!copy.contains_key("absent"));
        }
    }

    /// Counts the leaves and branches below `node`, and those `other`
    /// shares with it.
    fn nodes(node: &Arc<Node<u64, u64>>, other: Option<&Arc<Node<u64, u64>>>) -> (usize, usize) {
        let shared = other.is_some_and(|o| Arc::ptr_eq(node, o)) as usize;
        match &**node {
            Node::Leaf(_) => (1, shared),
            Node::Branch(children) => {
                let theirs = |i: usize| match other.map(|o| &**o) {
                    Some(Node::Branch(c)) => c[i].as_ref(),
                    _ => None,
                };
                children
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| c.as_ref().map(|c| nodes(c, theirs(i))))
                    .fold((1, shared), |(a, b), (c, d)| (a + c, b + d))
            }
        }
    }

    #[test]
    fn a_change_copies_only_the_path_to_its_leaf_and_the_leaves_stay_small() {
        let mut map: CowMap<u64, u64> = CowMap::default();
        for i in 0..100_000 {
            map.insert(i, i);
        }
        let before = map.clone();
        map.insert(7, 8);
        let root = map.root.as_ref().unwrap();
        let (count, shared) = nodes(root, before.root.as_ref());
        let copied = count - shared;
        assert!(
            (2..=MAX_DEPTH as usize + 1).contains(&copied),
            "copied {copied} of {count} nodes"
        );
        assert_eq!(before.get(&7), Some(&7));
        assert_eq!(map.get(&7), Some(&8));
        let mut stack = vec![&**root];
        let mut leaves = 0;
        while let Some(node) = stack.pop() {
            match node {
                Node::Leaf(t) => {
                    leaves += 1;
                    assert!(t.len() <= LEAF_MAX, "a leaf of {}", t.len());
                }
                Node::Branch(c) => stack.extend(c.iter().flatten().map(|c| &**c)),
            }
        }
        assert!(leaves >= 100_000 / LEAF_MAX, "{leaves} leaves");
        // Emptied, the map lets every node go.
        for i in 0..100_000 {
            assert_eq!(map.remove(&i), Some(if i == 7 { 8 } else { i }));
        }
        assert!(map.root.is_none() && map.is_empty());
        assert_eq!(before.len(), 100_000);
    }
}
