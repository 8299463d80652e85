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

    /// Whether both are copies of one map that neither has changed since
    /// (a change copies the root): equal contents, found without reading
    /// them. Two maps built apart are not the same, whatever they hold.
    pub fn same(&self, other: &Self) -> bool {
        self.root.as_ref().map(Arc::as_ptr) == other.root.as_ref().map(Arc::as_ptr)
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

/// A map made at once from entries staged in any order (a first push),
/// each leaf made once at its size: no path copied per entry, no table
/// grown entry by entry, no leaf split. Keys may be staged more than once.
pub struct Builder<K, S> {
    hasher: Hasher,
    entries: Vec<(u64, K, S)>,
}

/// Entries staged for one node below which the builder gives the rest of
/// the staging list back to the allocator as it goes (so the list and the
/// map it becomes are not both held whole).
const GIVE_BACK: usize = 1 << 14;

impl<K: Hash + Eq + Clone, S> Builder<K, S> {
    pub fn with_capacity(n: usize) -> Self {
        Builder {
            hasher: Hasher::default(),
            entries: Vec::with_capacity(n),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keeps the staged values `keep` says to.
    pub fn retain(&mut self, mut keep: impl FnMut(&S) -> bool) {
        self.entries.retain(|(_, _, s)| keep(s));
    }

    pub fn push(&mut self, key: K, staged: S) {
        let hash = self.hasher.hash_one(&key);
        self.entries.push((hash, key, staged));
    }

    /// The map: each key's value is `make` of one of its staged values,
    /// given the key's others by `merge` (in no set order: what they
    /// carry must say their order).
    pub fn build<V: Clone>(
        self,
        mut make: impl FnMut(S) -> V,
        mut merge: impl FnMut(&mut V, S),
    ) -> CowMap<K, V> {
        let Builder { hasher, entries } = self;
        let mut len = 0;
        let root = (!entries.is_empty()).then(|| {
            let mut build = Build {
                hasher: &hasher,
                len: &mut len,
                make: &mut make,
                merge: &mut merge,
            };
            Arc::new(build.node(entries, 0))
        });
        CowMap { hasher, len, root }
    }
}

struct Build<'a, M, G> {
    hasher: &'a Hasher,
    len: &'a mut usize,
    make: &'a mut M,
    merge: &'a mut G,
}

impl<M, G> Build<'_, M, G> {
    /// The node of `entries` (those under one path) at `depth`.
    fn node<K, S, V>(&mut self, mut entries: Vec<(u64, K, S)>, depth: u32) -> Node<K, V>
    where
        K: Hash + Eq,
        M: FnMut(S) -> V,
        G: FnMut(&mut V, S),
    {
        let splittable = entries.len() > LEAF_MAX
            && depth < MAX_DEPTH
            && entries.iter().any(|e| e.0 != entries[0].0);
        if !splittable {
            return Node::Leaf(self.leaf(entries.drain(..)));
        }
        let ends = partition(&mut entries, depth);
        let mut children: [Option<Arc<Node<K, V>>>; FANOUT] = Default::default();
        // From the last child back: each child's entries are split off the
        // list's end and the list shrunk, so what is left of the staging
        // list and what is built of the map are not both held whole.
        for c in (0..FANOUT).rev() {
            let start = if c == 0 { 0 } else { ends[c - 1] };
            if start == entries.len() {
                continue;
            }
            let mine = match start {
                0 => std::mem::take(&mut entries),
                _ => entries.split_off(start),
            };
            if entries.capacity() > GIVE_BACK && entries.capacity() > 2 * entries.len() {
                entries.shrink_to_fit();
            }
            children[c] = Some(Arc::new(if mine.len() > LEAF_MAX {
                self.node(mine, depth + 1)
            } else {
                Node::Leaf(self.leaf(mine.into_iter()))
            }));
        }
        Node::Branch(children)
    }

    fn leaf<K, S, V>(
        &mut self,
        entries: impl ExactSizeIterator<Item = (u64, K, S)>,
    ) -> HashTable<(K, V)>
    where
        K: Hash + Eq,
        M: FnMut(S) -> V,
        G: FnMut(&mut V, S),
    {
        let staged_len = entries.len();
        // Room for every entry staged, unless keys repeat past a leaf's
        // size (staged values of few keys): then it grows as they come.
        let mut table: HashTable<(K, V)> = HashTable::with_capacity(staged_len.min(LEAF_MAX));
        for (hash, key, staged) in entries {
            match table.find_mut(hash, |(k, _)| *k == key) {
                Some((_, v)) => (self.merge)(v, staged),
                None => {
                    let value = (self.make)(staged);
                    table.insert_unique(hash, (key, value), |(k, _)| self.hasher.hash_one(k));
                    *self.len += 1;
                }
            }
        }
        if table.len() < staged_len {
            // Keys repeated: no more room kept than the keys need.
            table.shrink_to(0, |(k, _)| self.hasher.hash_one(k));
        }
        table
    }
}

/// Orders `entries` in place by their child at `depth` (a counting sort:
/// one pass to count, one round of swaps); returns where each child's
/// entries end.
fn partition<K, S>(entries: &mut [(u64, K, S)], depth: u32) -> [usize; FANOUT] {
    let mut ends = [0usize; FANOUT];
    for e in entries.iter() {
        ends[child(e.0, depth)] += 1;
    }
    for c in 1..FANOUT {
        ends[c] += ends[c - 1];
    }
    // `next[c]`: the first place in child c's range not yet holding one
    // of its entries.
    let mut next = [0usize; FANOUT];
    next[1..].copy_from_slice(&ends[..FANOUT - 1]);
    for c in 0..FANOUT {
        while next[c] < ends[c] {
            let to = child(entries[next[c]].0, depth);
            if to == c {
                next[c] += 1;
            } else {
                entries.swap(next[c], next[to]);
                next[to] += 1;
            }
        }
    }
    ends
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

    /// Staged in any order with keys repeated (one far past a leaf's
    /// size), a map built at once holds each key once with its values
    /// merged, keeps its leaves small and no roomier than their keys
    /// need, and then changes as any map.
    #[test]
    fn a_map_built_at_once_holds_what_was_staged_and_then_changes_as_any() {
        let mut seed = 11u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut staged: Builder<u64, u64> = Builder::with_capacity(0);
        let mut model: HashMap<u64, u64> = HashMap::new();
        for i in 0..60_000u64 {
            let key = next() % 40_000;
            staged.push(key, i);
            *model.entry(key).or_default() += i;
        }
        for _ in 0..1_000 {
            staged.push(u64::MAX, 1);
        }
        model.insert(u64::MAX, 1_000);
        let mut map = staged.build(|v| v, |sum, v| *sum += v);
        assert_eq!(map.len(), model.len());
        for (k, v) in &model {
            assert_eq!(map.get(k), Some(v), "{k}");
        }
        let mut stack = vec![&**map.root.as_ref().unwrap()];
        let mut leaves = 0;
        while let Some(node) = stack.pop() {
            match node {
                Node::Leaf(t) => {
                    leaves += 1;
                    assert!(t.len() <= LEAF_MAX, "a leaf of {}", t.len());
                    let needed = HashTable::<(u64, u64)>::with_capacity(t.len()).capacity();
                    assert!(t.capacity() <= needed, "{} for {}", t.capacity(), t.len());
                }
                Node::Branch(c) => stack.extend(c.iter().flatten().map(|c| &**c)),
            }
        }
        assert!(leaves >= model.len() / LEAF_MAX, "{leaves} leaves");
        let copy = map.clone();
        for step in 0..20_000u64 {
            let key = next() % 50_000;
            if step % 3 == 0 {
                assert_eq!(map.remove(&key), model.remove(&key));
            } else {
                assert_eq!(map.insert(key, step), model.insert(key, step));
            }
        }
        assert_eq!(map.len(), model.len());
        for (k, v) in &model {
            assert_eq!(map.get(k), Some(v));
        }
        assert_eq!(copy.get(&u64::MAX), Some(&1_000));
        assert!(Builder::<u64, u64>::with_capacity(0)
            .build(|v| v, |_, _| {})
            .is_empty());
    }
}
