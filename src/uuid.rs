//! Random UUIDs (v4), as Envoy makes them for `x-request-id` and unnamed listeners: used by
//! the request path and by config loading, so it sits below both.

/// A random UUID v4, as Envoy generates for `x-request-id`.
pub fn v4() -> String {
    String::from_utf8_lossy(&v4_bytes()).into_owned()
}

/// The same UUID as ASCII on the stack: the request path turns it into a header value
/// without formatting machinery.
pub fn v4_bytes() -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let r = fastrand::u128(..);
    // Version 4 and the RFC 4122 variant.
    let r = (r & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let mut out = [b'-'; 36];
    let mut nibble = 0;
    for (i, slot) in out.iter_mut().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            continue;
        }
        *slot = HEX[((r >> (124 - 4 * nibble)) & 0xf) as usize];
        nibble += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::v4;

    #[test]
    fn uuids_are_v4() {
        let id = v4();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(id, v4());
        for (i, c) in id.chars().enumerate() {
            if matches!(i, 8 | 13 | 18 | 23) {
                assert_eq!(c, '-', "{id}");
            } else {
                assert!(matches!(c, '0'..='9' | 'a'..='f'), "{id}");
            }
        }
        // Every hex digit position varies: no nibble is lost or repeated.
        let ids: Vec<String> = (0..64).map(|_| v4()).collect();
        for i in (0..36).filter(|i| ![8, 13, 14, 18, 23].contains(i)) {
            let distinct: std::collections::BTreeSet<char> =
                ids.iter().filter_map(|id| id.chars().nth(i)).collect();
            assert!(distinct.len() > 1, "position {i} never changes");
        }
    }
}
