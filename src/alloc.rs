//! The global allocator: mimalloc, asked for alignment only when a type needs more than
//! every mimalloc block has, with a small per-thread cache of medium blocks on the workers.
//!
//! The `mimalloc` crate's allocator passes every request to `mi_malloc_aligned`, which
//! checks the alignment of the block it found on every call and takes a slower generic
//! path for a block over mimalloc's small-size limit (1 KiB) unless its size is a power of
//! two (a request's future, a header map's table). Every mimalloc block is aligned to the
//! machine word, so a layout asking no more than that is served by plain `mi_malloc`, as
//! the system allocator serves layouts up to its own guarantee; only larger alignments go
//! to the aligned entry points. Measured: 75.5k -> 73.6k user-space instructions per
//! proxied request (`scripts/instructions-per-request.sh`); anonymous RSS unchanged.
//!
//! Above 1 KiB even plain `mi_malloc` has no fast path: it looks the size's page queue up on
//! every call (`_mi_malloc_generic`), and a page of a few such blocks that empties is freed
//! and made again soon after. A proxied request makes five blocks of that size (its boxed
//! future, the read buffers of both heads, the entries of both header maps) and frees them
//! when it ends. So each worker thread keeps the medium blocks it frees (1-8 KiB, in
//! mimalloc's own size classes) on short per-class lists and hands them out again first.
use std::alloc::{GlobalAlloc, Layout};
use std::cell::UnsafeCell;
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// What every mimalloc block is aligned to: its block sizes are whole words.
const WORD: usize = std::mem::size_of::<usize>();

/// mimalloc, with the alignment passed on only when a layout needs more than a word.
pub struct MiAlloc;

/// Whether plain (unaligned) mimalloc calls satisfy a layout of this alignment and size.
#[inline]
fn plain(align: usize, size: usize) -> bool {
    align <= WORD && align <= size
}

/// The medium sizes the thread cache keeps: above mimalloc's fast-path limit (1 KiB), up to
/// 8 KiB, in mimalloc's size classes (four to a doubling: 1280, 1536, 1792, 2048, 2560, ...).
const CLASSES: usize = 12;
/// The bytes a thread keeps, over all classes: a worker's requests in flight rise and fall
/// by tens at a time (50 connections: up to 150 blocks of 4 KiB live at once), and a block
/// freed past the budget goes back to mimalloc.
const KEPT_BYTES: usize = 1 << 20;

/// A medium size's class and that class's block size, which every block of the class is
/// made with (so any of them serves any size of the class). `None` outside 1 KiB-8 KiB.
#[inline]
fn class(size: usize) -> Option<(usize, usize)> {
    if size <= 1024 || size > 8192 {
        return None;
    }
    let m = size - 1;
    let log = (usize::BITS - 1 - m.leading_zeros()) as usize; // 10..=12
    let step = log - 2;
    let k = m >> step; // 4..=7
    let c = (log - 10) * 4 + (k - 4);
    Some((c, class_size(c)))
}

/// The size mimalloc is asked for: a medium size's class size, else the size itself.
#[inline]
fn made_size(size: usize) -> usize {
    class(size).map_or(size, |(_, made)| made)
}

/// The block size of a class: four to a doubling, from 1,280 bytes.
#[inline]
fn class_size(class: usize) -> usize {
    (class % 4 + 5) << (class / 4 + 8)
}

/// A thread's kept blocks: per class, a list linked through each block's first word, the
/// most recently freed first.
struct Kept {
    on: bool,
    heads: [*mut u8; CLASSES],
    counts: [u32; CLASSES],
    /// Per class, the fewest blocks listed since the last trim: that many were not used.
    low: [u32; CLASSES],
    bytes: usize,
}

thread_local! {
    // No destructor: `ThreadCache` empties it where a thread turns it on, so taking it costs
    // no more than a thread-local address.
    static KEPT_BLOCKS: UnsafeCell<Kept> = const {
        UnsafeCell::new(Kept {
            on: false,
            heads: [std::ptr::null_mut(); CLASSES],
            counts: [0; CLASSES],
            low: [0; CLASSES],
            bytes: 0,
        })
    };
}

impl Kept {
    /// Gives back to mimalloc all but the first `keep` blocks of a class's list.
    ///
    /// # Safety
    /// The thread's own `Kept`, its lists as `take_kept` and `keep` leave them.
    unsafe fn free_past(&mut self, class: usize, keep: u32) {
        let mut link: *mut *mut u8 = &mut self.heads[class];
        for _ in 0..keep {
            if (*link).is_null() {
                return;
            }
            link = (*link).cast::<*mut u8>();
        }
        let mut block = *link;
        *link = std::ptr::null_mut();
        while !block.is_null() {
            let next = block.cast::<*mut u8>().read();
            mi::mi_free(block.cast::<c_void>());
            self.counts[class] -= 1;
            self.bytes -= class_size(class);
            block = next;
        }
    }
}

/// Turns the medium-block cache on for the calling thread until dropped, which gives the
/// kept blocks back to mimalloc. For long-lived threads that make and free such blocks at a
/// high rate (the workers), which call `trim` now and then; every other thread goes to
/// mimalloc directly.
pub struct ThreadCache(std::marker::PhantomData<*const ()>);

impl ThreadCache {
    pub fn on() -> ThreadCache {
        // SAFETY: the thread's own cell; nothing else holds a reference into it now.
        KEPT_BLOCKS.with(|k| unsafe { (*k.get()).on = true });
        ThreadCache(std::marker::PhantomData)
    }
}

/// Gives back to mimalloc the calling thread's kept blocks that no allocation took since the
/// last trim: a burst's leftovers (a worker's start-up loads the platform's certificates)
/// and the surplus of a load that fell. The blocks used since stay, as the load needs them.
pub fn trim() {
    let freed = KEPT_BLOCKS.with(|k| {
        let mut freed = false;
        // SAFETY: the thread's own cell, not reentered (mimalloc's free does not allocate).
        unsafe {
            let k = &mut *k.get();
            for class in 0..CLASSES {
                let unused = k.low[class];
                if unused > 0 {
                    k.free_past(class, k.counts[class] - unused);
                    freed = true;
                }
                k.low[class] = k.counts[class];
            }
        }
        freed
    });
    if freed {
        // mimalloc returns emptied pages to the system when it next allocates or frees
        // pages, which an idle worker does not: now, so the memory leaves the RSS.
        // SAFETY: a plain call on the calling thread's heap.
        unsafe { mi::mi_collect(false) };
    }
}

impl Drop for ThreadCache {
    fn drop(&mut self) {
        KEPT_BLOCKS.with(|k| {
            // SAFETY: the thread's own cell.
            unsafe {
                let k = &mut *k.get();
                k.on = false;
                for class in 0..CLASSES {
                    k.free_past(class, 0);
                    k.low[class] = 0;
                }
            }
        });
    }
}

/// A kept block of the class (of `made` bytes), if the thread keeps any.
#[inline]
fn take_kept(class: usize, made: usize) -> Option<*mut u8> {
    KEPT_BLOCKS.with(|k| {
        // SAFETY: the thread's own cell, not reentered (mimalloc is not called here). A
        // listed block is a freed one of at least the class's size, linked through its
        // first word.
        unsafe {
            let k = &mut *k.get();
            let head = *k.heads.get_unchecked(class);
            if head.is_null() {
                return None;
            }
            *k.heads.get_unchecked_mut(class) = head.cast::<*mut u8>().read();
            let count = k.counts.get_unchecked_mut(class);
            *count -= 1;
            let low = k.low.get_unchecked_mut(class);
            *low = (*low).min(*count);
            k.bytes -= made;
            Some(head)
        }
    })
}

/// Keeps a freed block of the class (of `made` bytes) if the thread keeps blocks and has
/// room; else false.
#[inline]
fn keep(class: usize, made: usize, block: *mut u8) -> bool {
    KEPT_BLOCKS.with(|k| {
        // SAFETY: as `take_kept`; the block is freed by its owner and at least a word long.
        unsafe {
            let k = &mut *k.get();
            if !k.on || k.bytes + made > KEPT_BYTES {
                return false;
            }
            k.bytes += made;
            *k.counts.get_unchecked_mut(class) += 1;
            let head = k.heads.get_unchecked_mut(class);
            block.cast::<*mut u8>().write(*head);
            *head = block;
            true
        }
    })
}

// SAFETY: every pointer comes from mimalloc and goes back to it; mimalloc's blocks are at
// least word-aligned, so `plain` layouts get memory as aligned as they ask, and the others
// use mimalloc's aligned calls, which honour any power-of-two alignment. `mi_free` frees
// blocks from either kind of call. A plain medium block is always made (and grown) at its
// class's size, so a kept block serves any later request of its class.
unsafe impl GlobalAlloc for MiAlloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let (size, align) = (layout.size(), layout.align());
        if plain(align, size) {
            match class(size) {
                Some((c, made)) => match take_kept(c, made) {
                    Some(block) => block,
                    None => mi::mi_malloc(made).cast(),
                },
                None => mi::mi_malloc(size).cast(),
            }
        } else {
            mi::mi_malloc_aligned(size, align).cast()
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let (size, align) = (layout.size(), layout.align());
        if plain(align, size) {
            mi::mi_zalloc(made_size(size)).cast()
        } else {
            mi::mi_zalloc_aligned(size, align).cast()
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if plain(layout.align(), layout.size()) {
            if let Some((c, made)) = class(layout.size()) {
                if keep(c, made, ptr) {
                    return;
                }
            }
        }
        mi::mi_free(ptr.cast::<c_void>());
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        if plain(align, new_size) {
            mi::mi_realloc(ptr.cast::<c_void>(), made_size(new_size)).cast()
        } else {
            mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, align).cast()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_sizes_fall_in_mimallocs_classes() {
        assert_eq!(class(1024), None);
        assert_eq!(class(8193), None);
        assert_eq!(class(1025), Some((0, 1280)));
        assert_eq!(class(1280), Some((0, 1280)));
        assert_eq!(class(1281), Some((1, 1536)));
        assert_eq!(class(2048), Some((3, 2048)));
        assert_eq!(class(2049), Some((4, 2560)));
        assert_eq!(class(4080), Some((7, 4096)));
        assert_eq!(class(4096), Some((7, 4096)));
        assert_eq!(class(8192), Some((11, 8192)));
        let mut last = (0, 1024);
        for size in 1025..=8192 {
            let (c, made) = class(size).expect("medium");
            assert!(made >= size && c < CLASSES, "{size}");
            // Classes grow with the size, and one class has one block size.
            assert!(
                c == last.0 && made == last.1 || c == last.0 + 1 && made > last.1 || size == 1025
            );
            // SAFETY: a plain size mimalloc serves; its usable size is what the class needs.
            let usable = unsafe {
                let p = mi::mi_malloc(made);
                let u = mi::mi_usable_size(p);
                mi::mi_free(p);
                u
            };
            assert_eq!(usable, made, "mimalloc's class for {size}");
            last = (c, made);
        }
    }

    #[test]
    fn a_thread_reuses_its_freed_medium_blocks_until_it_turns_the_cache_off() {
        let a = MiAlloc;
        let big = Layout::from_size_align(2500, 8).expect("layout");
        let other = Layout::from_size_align(2100, 8).expect("layout");
        let small = Layout::from_size_align(512, 8).expect("layout");
        // SAFETY: blocks written within the sizes asked, each freed once with its layout.
        unsafe {
            // Off: freed blocks go back to mimalloc, nothing is kept.
            let p = a.alloc(big);
            a.dealloc(p, big);
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).bytes), 0);

            let cache = ThreadCache::on();
            let p = a.alloc(big);
            std::ptr::write_bytes(p, 1, 2500);
            a.dealloc(p, big);
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).bytes), 2560);
            // Another size of the same class (2049-2560) gets the kept block, whole.
            let q = a.alloc(other);
            assert_eq!(q, p);
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).bytes), 0);
            std::ptr::write_bytes(q, 2, 2560);
            // Small sizes are mimalloc's own.
            let s = a.alloc(small);
            a.dealloc(s, small);
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).bytes), 0);
            // No more than KEPT_BYTES are kept.
            let n = KEPT_BYTES / 2560 + 5;
            let blocks: Vec<*mut u8> = (0..n).map(|_| a.alloc(big)).collect();
            a.dealloc(q, other);
            for b in blocks {
                a.dealloc(b, big);
            }
            assert_eq!(
                KEPT_BLOCKS.with(|k| (*k.get()).bytes),
                KEPT_BYTES / 2560 * 2560
            );
            // A trim frees what no allocation took since the last one: here, nothing yet.
            trim();
            let full = KEPT_BYTES / 2560;
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).counts[4]), full as u32);
            // Ten taken and given back since: they stay, the others go.
            let ten: Vec<*mut u8> = (0..10).map(|_| a.alloc(big)).collect();
            for b in ten.iter().rev() {
                a.dealloc(*b, big);
            }
            trim();
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).counts[4]), 10);
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).bytes), 10 * 2560);
            // The kept ones are the ones used last.
            let again: Vec<*mut u8> = (0..10).map(|_| a.alloc(big)).collect();
            assert_eq!(again, ten);
            for b in again {
                a.dealloc(b, big);
            }
            // Unused through a whole period: gone.
            trim();
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).counts[4]), 10);
            trim();
            assert_eq!(KEPT_BLOCKS.with(|k| (*k.get()).bytes), 0);
            let p = a.alloc(big);
            a.dealloc(p, big);
            drop(cache);
            assert!(KEPT_BLOCKS.with(|k| {
                let k = &*k.get();
                !k.on
                    && k.heads.iter().all(|h| h.is_null())
                    && k.counts.iter().all(|c| *c == 0)
                    && k.bytes == 0
            }));
        }
    }

    #[test]
    fn every_layout_gets_its_alignment_and_keeps_its_bytes() {
        let a = MiAlloc;
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for size in [1, 3, 8, 24, 100, 1176, 4096, 5432, 70_000] {
                let layout = Layout::from_size_align(size, align).expect("layout");
                // SAFETY: non-zero sizes; each block is written within its size, read back,
                // grown by realloc with the same alignment, and freed once.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "alloc {size} aligned {align}");
                    std::ptr::write_bytes(p, 0xa5, size);
                    let grown = size * 3 + 5;
                    let q = a.realloc(p, layout, grown);
                    assert_eq!(q as usize % align, 0, "realloc {grown} aligned {align}");
                    assert!(std::slice::from_raw_parts(q, size)
                        .iter()
                        .all(|b| *b == 0xa5));
                    a.dealloc(q, Layout::from_size_align(grown, align).expect("layout"));
                    let z = a.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "zalloc {size} aligned {align}");
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|b| *b == 0));
                    a.dealloc(z, layout);
                }
            }
        }
    }
}
