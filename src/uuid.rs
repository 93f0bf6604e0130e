//! Random UUIDs (v4), as Envoy makes them for `x-request-id` and unnamed listeners: used by
//! the request path and by config loading, so it sits below both.

/// A random UUID v4, as Envoy generates for `x-request-id`.
pub fn v4() -> String {
    String::from_utf8_lossy(&v4_bytes()).into_owned()
}

/// The same UUID as ASCII on the stack: the request path turns it into a header value
/// without formatting machinery.
pub fn v4_bytes() -> [u8; 36] {
    format_v4(fastrand::u128(..))
}

/// 128 random bits as a v4 UUID: the version nibble and RFC 4122 variant bits set, then two
/// hex digits per byte at positions known in advance (a table lookup each; the loop unrolls,
/// where deciding each dash's place as it went cost ~360 instructions a request).
fn format_v4(r: u128) -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    const AT: [usize; 16] = [0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34];
    let mut b = r.to_be_bytes();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let mut out = [b'-'; 36];
    for (byte, at) in b.iter().zip(AT) {
        out[at] = HEX[usize::from(byte >> 4)];
        out[at + 1] = HEX[usize::from(byte & 0xf)];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{format_v4, v4};

    #[test]
    fn bits_become_digits_in_order_with_version_and_variant_set() {
        let f = |r: u128| String::from_utf8(format_v4(r).to_vec()).expect("ascii");
        assert_eq!(
            f(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef),
            "01234567-89ab-4def-8123-456789abcdef"
        );
        assert_eq!(f(0), "00000000-0000-4000-8000-000000000000");
        assert_eq!(f(u128::MAX), "ffffffff-ffff-4fff-bfff-ffffffffffff");
    }

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
