//! Unit tests of `backend::cpu` (a file of their own to keep the module under the file-size guide).

use super::*;

#[test]
fn e8m0_table() {
    assert_eq!(e8m0(127), 1.0);
    assert_eq!(e8m0(128), 2.0);
    assert_eq!(e8m0(126), 0.5);
    assert_eq!(e8m0(0), 2f32.powi(-127));
    assert_eq!(e8m0(1), 2f32.powi(-126));
    assert!(e8m0(255).is_nan());
}

#[test]
fn reduce_tree_order() {
    let mut a = [0f32; 16];
    a[0] = 1e8;
    a[8] = -1e8;
    a[1] = 1.0;
    assert_eq!(reduce16(&a), 1.0);
}
