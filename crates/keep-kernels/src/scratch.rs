//! Buffers kept between calls: [`recycle`], which turns an emptied vector into an empty vector
//! of another element type over the same allocation. A buffer of borrowed views (kernel jobs,
//! weight views) cannot outlive its borrows, but its allocation can: kept as the `'static`
//! form of the type between calls and recycled into the borrowing form for each call, it is
//! allocated once. A leaf: it knows no kernel.

/// `v` emptied, as a vector of `U`. When `T` and `U` have one size and alignment (the same
/// type under other lifetimes, what every caller passes) the allocation is reused through the
/// standard library's in-place collection: no allocation, no copy; otherwise the result is a
/// fresh empty vector. No value is converted: `v` is emptied first.
pub fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter()
        .map(|_| -> U { unreachable!("emptied") })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycle_keeps_the_allocation_for_the_same_layout() {
        let mut v: Vec<&'static [f32]> = Vec::with_capacity(16);
        v.push(&[1.0]);
        let p = v.as_ptr() as usize;
        let data = [2f32; 3];
        let mut w: Vec<&[f32]> = recycle(v);
        assert!(w.is_empty());
        assert!(w.capacity() >= 16);
        w.push(&data[..]);
        assert_eq!(w.as_ptr() as usize, p);
        let back: Vec<&'static [f32]> = recycle(w);
        assert_eq!((back.len(), back.as_ptr() as usize), (0, p));
    }
}
