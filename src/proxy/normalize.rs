//! The connection manager's path normalization (`normalize_path`, `merge_slashes`,
//! `path_with_escaped_slashes_action`), as Envoy applies it to `:path` before routing: escaped
//! slashes first, then RFC 3986 normalization as Chromium's URL canonicalizer does it (Envoy
//! embeds a copy), then merged slashes. The query is never touched.

use crate::snapshot::listener::{EscapedSlashes, PathNormalization};

/// What becomes of the request.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Route (and forward) this path; None: unchanged.
    Continue(Option<String>),
    /// 400: the path cannot be normalized, or escaped slashes are refused.
    Reject,
    /// 307 to this path (UNESCAPE_AND_REDIRECT found escaped slashes).
    Redirect(String),
}

pub fn apply(cfg: &PathNormalization, original: &str) -> Action {
    let mut path = std::borrow::Cow::Borrowed(original);
    let mut redirect = false;
    if cfg.escaped_slashes != EscapedSlashes::Keep {
        if let Some(unescaped) = unescape_slashes(&path) {
            match cfg.escaped_slashes {
                EscapedSlashes::Reject => return Action::Reject,
                EscapedSlashes::Redirect => redirect = true,
                _ => {}
            }
            path = unescaped.into();
        }
    }
    if cfg.normalize {
        match canonical(&path) {
            Some(p) => path = p.into(),
            None => return Action::Reject,
        }
    }
    if cfg.merge_slashes {
        if let Some(p) = merge_slashes(&path) {
            path = p.into();
        }
    }
    if redirect {
        return Action::Redirect(path.into_owned());
    }
    match path {
        std::borrow::Cow::Borrowed(_) => Action::Continue(None),
        std::borrow::Cow::Owned(p) if p == original => Action::Continue(None),
        std::borrow::Cow::Owned(p) => Action::Continue(Some(p)),
    }
}

fn split_query(p: &str) -> (&str, &str) {
    match p.find('?') {
        Some(i) => p.split_at(i),
        None => (p, ""),
    }
}

/// `%2F`/`%2f` to `/` and `%5C`/`%5c` to `\` in the path part; None when there are none.
fn unescape_slashes(p: &str) -> Option<String> {
    let (path, query) = split_query(p);
    if !path.contains('%') {
        return None;
    }
    let mut out = String::with_capacity(p.len());
    let b = path.as_bytes();
    let mut i = 0;
    let mut found = false;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let code = [b[i + 1], b[i + 2]];
            let c = match &code {
                b"2F" | b"2f" => Some('/'),
                b"5C" | b"5c" => Some('\\'),
                _ => None,
            };
            if let Some(c) = c {
                out.push(c);
                found = true;
                i += 3;
                continue;
            }
        }
        // Whole UTF-8 characters: the input is a valid str, and only ASCII is matched above.
        let ch_len = utf8_len(b[i]);
        out.push_str(&path[i..i + ch_len]);
        i += ch_len;
    }
    if !found {
        return None;
    }
    out.push_str(query);
    Some(out)
}

fn utf8_len(first: u8) -> usize {
    match first {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    }
}

/// Chromium's `CanonicalizePath` on the path part, the query appended as it was; None when the
/// path holds what Chromium calls invalid (a NUL, raw or escaped).
pub fn canonical(p: &str) -> Option<String> {
    let (path, query) = split_query(p);
    let s = path.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(p.len() + 1);
    let mut ok = true;
    if s.is_empty() {
        out.push(b'/');
    } else {
        if !is_slash(s[0]) {
            out.push(b'/');
        }
        // Where the last '%' that did not start a valid escape went in `out`.
        let mut last_invalid_percent: Option<usize> = None;
        let end = s.len();
        let mut i = 0;
        while i < end {
            let ch = s[i];
            let flags = CLASS[usize::from(ch)];
            if flags & SPECIAL == 0 {
                out.push(ch);
                i += 1;
                continue;
            }
            let dot = dot_len(s, i);
            if dot > 0 {
                if out.last() == Some(&b'/') {
                    match after_dot(s, i + dot) {
                        (Dot::NotDirectory, _) => {
                            out.push(b'.');
                            i += dot;
                        }
                        (Dot::Current, consumed) => i += dot + consumed,
                        (Dot::Up, consumed) => {
                            back_up_to_previous_slash(&mut out);
                            i += dot + consumed;
                        }
                    }
                } else {
                    out.push(b'.');
                    i += dot;
                }
            } else if ch == b'\\' {
                out.push(b'/');
                i += 1;
            } else if ch == b'%' {
                match decode_escaped(s, i) {
                    Some(v) => {
                        let vf = CLASS[usize::from(v)];
                        if vf & UNESCAPE != 0 {
                            out.push(v);
                            if let Some(p) = last_invalid_percent {
                                if p + 3 >= out.len() {
                                    check_nested_escapes(s, i + 3, p, &mut out);
                                }
                            }
                        } else {
                            out.extend_from_slice(&s[i..i + 3]);
                            if vf & INVALID_BIT != 0 {
                                ok = false;
                            }
                        }
                        i += 3;
                    }
                    None => {
                        last_invalid_percent = Some(out.len());
                        out.push(b'%');
                        i += 1;
                    }
                }
            } else if flags & INVALID_BIT != 0 {
                push_escaped(&mut out, ch);
                ok = false;
                i += 1;
            } else {
                // ESCAPE
                push_escaped(&mut out, ch);
                i += 1;
            }
        }
    }
    if !ok {
        return None;
    }
    out.extend_from_slice(query.as_bytes());
    // Only ASCII was written for anything not copied, and copied bytes are whole UTF-8
    // sequences' bytes, which are all escaped (>= 0x80 is ESCAPE): the output is ASCII.
    String::from_utf8(out).ok()
}

fn is_slash(c: u8) -> bool {
    c == b'/' || c == b'\\'
}

/// 1 for `.`, 3 for `%2e`/`%2E`, else 0.
fn dot_len(s: &[u8], i: usize) -> usize {
    if s[i] == b'.' {
        1
    } else if s[i] == b'%'
        && i + 3 <= s.len()
        && s[i + 1] == b'2'
        && matches!(s[i + 2], b'e' | b'E')
    {
        3
    } else {
        0
    }
}

enum Dot {
    NotDirectory,
    Current,
    Up,
}

/// What a dot right after a slash means, and how many input bytes after it belong to it.
fn after_dot(s: &[u8], after: usize) -> (Dot, usize) {
    let end = s.len();
    if after == end {
        return (Dot::Current, 0);
    }
    if is_slash(s[after]) {
        return (Dot::Current, 1);
    }
    let second = dot_len(s, after);
    if second > 0 {
        let after2 = after + second;
        if after2 == end {
            return (Dot::Up, second);
        }
        if is_slash(s[after2]) {
            return (Dot::Up, second + 1);
        }
    }
    (Dot::NotDirectory, 0)
}

/// `out` ends with a slash: drop the last segment, never above the first slash.
fn back_up_to_previous_slash(out: &mut Vec<u8>) {
    let mut i = out.len() - 1;
    if i == 0 {
        return;
    }
    i -= 1;
    while out[i] != b'/' && i > 0 {
        i -= 1;
    }
    out.truncate(i + 1);
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn decode_escaped(s: &[u8], i: usize) -> Option<u8> {
    if i + 3 > s.len() {
        return None;
    }
    Some(hex(s[i + 1])? << 4 | hex(s[i + 2])?)
}

fn push_escaped(out: &mut Vec<u8>, c: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push(b'%');
    out.push(HEX[usize::from(c >> 4)]);
    out.push(HEX[usize::from(c & 0xf)]);
}

/// Chromium's guard against `%%30` turning into a valid escape once the inner one is decoded:
/// the earlier `%` becomes `%25`.
fn check_nested_escapes(s: &[u8], next: usize, percent: usize, out: &mut Vec<u8>) {
    let len = out.len();
    let last = out[len - 1];
    let append_next = percent + 2 == len;
    if append_next {
        if next >= s.len() || s[next] >= 0x80 {
            return;
        }
        out.push(s[next]);
    }
    if decode_escaped(out, percent).is_some() {
        if !append_next {
            let c = out[percent + 1];
            out.push(c);
        }
        out[percent + 1] = b'2';
        out[percent + 2] = b'5';
        out.push(last);
    } else if append_next {
        out.truncate(len);
    }
}

/// Envoy's `mergeSlashes`: runs of `/` in the path part become one, keeping a leading and a
/// trailing slash; None when there is no `//`.
fn merge_slashes(p: &str) -> Option<String> {
    let (path, query) = split_query(p);
    if !path.contains("//") {
        return None;
    }
    let mut out = String::with_capacity(p.len());
    if path.starts_with('/') {
        out.push('/');
    }
    let mut first = true;
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        if !first {
            out.push('/');
        }
        out.push_str(seg);
        first = false;
    }
    if path.ends_with('/') {
        out.push('/');
    }
    out.push_str(query);
    Some(out)
}

const SPECIAL: u8 = 1;
const ESCAPE_BIT: u8 = 2;
const ESCAPE: u8 = ESCAPE_BIT | SPECIAL;
const UNESCAPE: u8 = 4;
const INVALID_BIT: u8 = 8;
const INVALID: u8 = INVALID_BIT | SPECIAL;
const PASS: u8 = 0;

/// Chromium's `kPathCharLookup`: how each byte is treated in a path.
const CLASS: [u8; 256] = {
    let mut t = [ESCAPE; 256];
    t[0] = INVALID;
    let mut c = b'0';
    while c <= b'9' {
        t[c as usize] = UNESCAPE;
        c += 1;
    }
    c = b'A';
    while c <= b'Z' {
        t[c as usize] = UNESCAPE;
        c += 1;
    }
    c = b'a';
    while c <= b'z' {
        t[c as usize] = UNESCAPE;
        c += 1;
    }
    t[b'-' as usize] = UNESCAPE;
    t[b'_' as usize] = UNESCAPE;
    t[b'~' as usize] = UNESCAPE;
    t[b'.' as usize] = SPECIAL;
    let pass = b"!$&'()*+,/:;=@[]";
    let mut i = 0;
    while i < pass.len() {
        t[pass[i] as usize] = PASS;
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    fn norm() -> PathNormalization {
        PathNormalization {
            normalize: true,
            ..Default::default()
        }
    }

    #[test]
    fn dot_segments_and_escapes_as_envoy_normalizes_them() {
        for (input, want) in [
            ("/a/b/../c", "/a/c"),
            ("/a/./b/.", "/a/b/"),
            ("/../../a", "/a"),
            ("/a/%2e%2E/b", "/b"),
            ("/a/..", "/"),
            ("/%41%62%7e%2D", "/Ab~-"),
            ("/a b", "/a%20b"),
            ("/a\\b", "/a/b"),
            ("/a%2fb", "/a%2fb"),
            ("/caf\u{e9}", "/caf%C3%A9"),
            ("/a/..?x=/../y", "/?x=/../y"),
            ("/a//b", "/a//b"),
            ("a/b", "/a/b"),
            ("/%zz", "/%zz"),
            ("/a.b/..c/", "/a.b/..c/"),
            ("/{x}|", "/%7Bx%7D%7C"),
        ] {
            assert_eq!(canonical(input).as_deref(), Some(want), "{input}");
        }
        assert_eq!(canonical("/a%00b"), None);
        assert_eq!(apply(&norm(), "/a%00"), Action::Reject);
        assert_eq!(apply(&norm(), "/a/b"), Action::Continue(None));
        assert_eq!(
            apply(&norm(), "/a/../b"),
            Action::Continue(Some("/b".into()))
        );
    }

    #[test]
    fn nested_escapes_are_not_made_valid() {
        assert_eq!(canonical("/%%30%30").as_deref(), Some("/%2500"));
    }

    #[test]
    fn merge_slashes_and_escaped_slash_actions() {
        let merge = PathNormalization {
            merge_slashes: true,
            ..Default::default()
        };
        assert_eq!(
            apply(&merge, "//a///b/?q=//"),
            Action::Continue(Some("/a/b/?q=//".into()))
        );
        let forward = PathNormalization {
            normalize: true,
            merge_slashes: true,
            escaped_slashes: EscapedSlashes::Forward,
        };
        assert_eq!(
            apply(&forward, "/a%2F%2fb%5Cc"),
            Action::Continue(Some("/a/b/c".into()))
        );
        let reject = PathNormalization {
            escaped_slashes: EscapedSlashes::Reject,
            ..Default::default()
        };
        assert_eq!(apply(&reject, "/a%2Fb"), Action::Reject);
        assert_eq!(apply(&reject, "/a%20b"), Action::Continue(None));
        let redirect = PathNormalization {
            normalize: true,
            escaped_slashes: EscapedSlashes::Redirect,
            ..Default::default()
        };
        assert_eq!(
            apply(&redirect, "/a%2f..%2fb?x"),
            Action::Redirect("/b?x".into())
        );
    }
}
