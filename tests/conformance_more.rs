mod common;

#[test]
fn stub() {}
