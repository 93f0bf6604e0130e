//! The run's medians as SVG charts, written by hand (plain SVG 1.1: no scripts, no external
//! fonts or styles, so GitHub renders them in a README): added latency at the fixed rates,
//! CPU per 100,000 requests, and memory.
//!
//! The checks of this module run under `cargo test --bench vs-envoy` (the bench has no test
//! harness, so no `#[test]`): see [`self_test`].

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::cases::RATES;
use crate::tools::{median_of, Proxy, Results};

/// One bar series (a contender): its legend name and fill.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub color: &'static str,
}

/// One group of bars on the x axis: a value per series, `None` where it has none.
#[derive(Clone, Debug)]
pub struct Group {
    pub label: String,
    pub values: Vec<Option<f64>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    Linear,
    /// Decades; a value at or below zero gets no bar, only its label on the axis.
    Log,
}

#[derive(Clone, Debug)]
pub struct Chart {
    pub title: String,
    pub subtitle: String,
    pub y_label: String,
    pub x_label: String,
    pub series: Vec<Series>,
    pub groups: Vec<Group>,
    pub scale: Scale,
}

/// The contenders' colours (colour-blind-safe Okabe-Ito hues).
pub fn color(p: Proxy) -> &'static str {
    match p {
        Proxy::Portico => "#0072B2",
        Proxy::Envoy => "#D55E00",
        Proxy::Nginx => "#009E73",
        Proxy::Haproxy => "#CC79A7",
    }
}

const BAR_W: f64 = 34.0;
const GROUP_GAP: f64 = 30.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 92.0;
const PLOT_H: f64 = 300.0;
const BOTTOM: f64 = 70.0;
const FONT: &str = "font-family=\"Helvetica, Arial, sans-serif\"";

/// Text with the five XML specials escaped.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// A figure as printed on a bar: three significant digits, no exponent.
pub fn fmt_value(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.01 || a == 0.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

/// An axis tick's label: as short as the tick allows.
fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// A "nice" step (1, 2 or 5 times a power of ten) giving about `n` ticks over `span`.
pub fn nice_step(span: f64, n: usize) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Maps a value to its height above the plot's bottom, and lists the ticks.
struct Axis {
    scale: Scale,
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Axis {
    fn new(scale: Scale, values: &[f64]) -> Axis {
        match scale {
            Scale::Linear => {
                let max = values.iter().copied().fold(0.0, f64::max);
                let min = values.iter().copied().fold(0.0, f64::min);
                let step = nice_step(max - min, 5);
                let lo = (min / step).floor() * step;
                let mut hi = (max / step).ceil() * step;
                if hi <= lo {
                    hi = lo + step;
                }
                let mut ticks = Vec::new();
                let mut t = lo;
                while t <= hi + step * 1e-9 {
                    // Rounded, so 0.30000000000000004 prints as 0.3.
                    ticks.push((t / step).round() * step);
                    t += step;
                }
                Axis {
                    scale,
                    lo,
                    hi,
                    ticks,
                }
            }
            Scale::Log => {
                let pos: Vec<f64> = values.iter().copied().filter(|v| *v > 0.0).collect();
                let min = pos.iter().copied().fold(f64::INFINITY, f64::min);
                let max = pos.iter().copied().fold(0.0, f64::max);
                let (mut lo, mut hi) = if pos.is_empty() {
                    (0.0, 1.0)
                } else {
                    (min.log10().floor(), max.log10().ceil())
                };
                if hi <= lo {
                    hi = lo + 1.0;
                }
                // A bar for the smallest value, not a sliver on the axis.
                if !pos.is_empty() && min.log10() - lo < 0.15 {
                    lo -= 1.0;
                }
                let ticks = (lo as i32..=hi as i32).map(|e| 10f64.powi(e)).collect();
                Axis {
                    scale,
                    lo: 10f64.powf(lo),
                    hi: 10f64.powf(hi),
                    ticks,
                }
            }
        }
    }

    /// Height above the plot's bottom edge, 0..=PLOT_H; `None` off a log axis.
    fn y(&self, v: f64) -> Option<f64> {
        let f = match self.scale {
            Scale::Linear => (v - self.lo) / (self.hi - self.lo),
            Scale::Log => {
                if v <= 0.0 {
                    return None;
                }
                (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
            }
        };
        Some(f.clamp(0.0, 1.0) * PLOT_H)
    }

    /// Where bars start: zero on a linear axis (within its range), the bottom on a log one.
    fn base(&self) -> f64 {
        match self.scale {
            Scale::Linear => self.y(0.0).unwrap_or(0.0),
            Scale::Log => 0.0,
        }
    }
}

/// The chart as an SVG document, or `None` when it has no value to show.
pub fn render(c: &Chart) -> Option<String> {
    let values: Vec<f64> = c
        .groups
        .iter()
        .flat_map(|g| g.values.iter().flatten().copied())
        .filter(|v| v.is_finite())
        .collect();
    if values.is_empty() || c.series.is_empty() {
        return None;
    }
    let axis = Axis::new(c.scale, &values);
    let n = c.series.len() as f64;
    // Each group as wide as its bars, or as its label (12 px text, about 7 px a character).
    let label_w = c
        .groups
        .iter()
        .map(|g| g.label.chars().count() as f64 * 7.0 + 16.0)
        .fold(0.0, f64::max);
    let group_w = (n * BAR_W + GROUP_GAP).max(label_w);
    let plot_w = group_w * c.groups.len() as f64;
    let legend_w: f64 = c
        .series
        .iter()
        .map(|s| 28.0 + 7.5 * s.name.chars().count() as f64)
        .sum();
    // Wide enough for the plot, the legend and the titles (about 0.55 em a character).
    let text_w =
        (c.title.chars().count() as f64 * 9.5).max(c.subtitle.chars().count() as f64 * 6.0) + 40.0;
    let width = (LEFT + plot_w + RIGHT)
        .max(LEFT + legend_w + RIGHT)
        .max(text_w)
        .max(560.0)
        .ceil();
    let plot_w = width - LEFT - RIGHT;
    let group_w = plot_w / c.groups.len() as f64;
    let height = TOP + PLOT_H + BOTTOM;
    let bottom = TOP + PLOT_H;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" role=\"img\" aria-label=\"{}\" {FONT}>",
        esc(&c.title)
    );
    let _ = writeln!(s, "<title>{}</title>", esc(&c.title));
    // Opaque: readable on GitHub's dark theme too.
    let _ = writeln!(
        s,
        "<rect x=\"0\" y=\"0\" width=\"{width}\" height=\"{height}\" fill=\"#ffffff\"/>"
    );
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\" \
         fill=\"#222222\">{}</text>",
        width / 2.0,
        esc(&c.title)
    );
    if !c.subtitle.is_empty() {
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"42\" text-anchor=\"middle\" font-size=\"11\" fill=\"#555555\">{}</text>",
            width / 2.0,
            esc(&c.subtitle)
        );
    }
    // Legend, one row, centred.
    let mut x = (width - legend_w) / 2.0;
    for ser in &c.series {
        let _ = writeln!(
            s,
            "<rect class=\"swatch\" x=\"{x:.1}\" y=\"56\" width=\"12\" height=\"12\" fill=\"{}\"/>\
             <text x=\"{:.1}\" y=\"66\" font-size=\"12\" fill=\"#222222\">{}</text>",
            ser.color,
            x + 16.0,
            esc(&ser.name)
        );
        x += 28.0 + 7.5 * ser.name.chars().count() as f64;
    }
    // Grid and y ticks.
    for t in &axis.ticks {
        let Some(h) = axis.y(*t) else { continue };
        let y = bottom - h;
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#e0e0e0\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" font-size=\"11\" fill=\"#444444\">{}</text>",
            LEFT + plot_w,
            LEFT - 6.0,
            y + 4.0,
            fmt_tick(*t)
        );
    }
    let y_mid = TOP + PLOT_H / 2.0;
    let scale_note = if c.scale == Scale::Log {
        " (log scale)"
    } else {
        ""
    };
    let _ = writeln!(
        s,
        "<text x=\"16\" y=\"{y_mid}\" text-anchor=\"middle\" font-size=\"12\" fill=\"#222222\" \
         transform=\"rotate(-90 16 {y_mid})\">{}{scale_note}</text>",
        esc(&c.y_label)
    );
    // Bars, values over them, group labels under.
    let base = axis.base();
    for (gi, g) in c.groups.iter().enumerate() {
        let gx = LEFT + gi as f64 * group_w;
        let x0 = gx + (group_w - n * BAR_W) / 2.0;
        for (si, v) in g.values.iter().enumerate().take(c.series.len()) {
            let Some(v) = v.filter(|v| v.is_finite()) else {
                continue;
            };
            let bx = x0 + si as f64 * BAR_W + 2.0;
            let bw = BAR_W - 4.0;
            let cx = bx + bw / 2.0;
            match axis.y(v) {
                Some(h) => {
                    let (top, bh) = if h >= base {
                        (h, h - base)
                    } else {
                        (base, base - h)
                    };
                    let _ = writeln!(
                        s,
                        "<rect class=\"bar\" x=\"{bx:.1}\" y=\"{:.2}\" width=\"{bw:.1}\" \
                         height=\"{bh:.2}\" fill=\"{}\"><title>{}: {}</title></rect>",
                        bottom - top,
                        c.series[si].color,
                        esc(&c.series[si].name),
                        fmt_value(v)
                    );
                    // Above a bar going up, below one going down.
                    let ly = if h >= base {
                        bottom - h - 4.0
                    } else {
                        bottom - h + 12.0
                    };
                    let _ = writeln!(
                        s,
                        "<text class=\"value\" x=\"{cx:.1}\" y=\"{ly:.1}\" text-anchor=\"middle\" \
                         font-size=\"10\" fill=\"#222222\">{}</text>",
                        fmt_value(v)
                    );
                }
                None => {
                    // Zero or below on a log axis: no bar, the figure on the axis.
                    let _ = writeln!(
                        s,
                        "<text class=\"value\" x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\" \
                         font-size=\"10\" fill=\"{}\">{}</text>",
                        bottom - 4.0,
                        c.series[si].color,
                        fmt_value(v)
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"12\" fill=\"#222222\">{}</text>",
            gx + group_w / 2.0,
            bottom + 18.0,
            esc(&g.label)
        );
    }
    // Axes over the bars.
    let zero = bottom - base;
    let _ = writeln!(
        s,
        "<line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{bottom}\" stroke=\"#444444\"/>\
         <line x1=\"{LEFT}\" y1=\"{zero:.1}\" x2=\"{:.1}\" y2=\"{zero:.1}\" stroke=\"#444444\"/>",
        LEFT + plot_w
    );
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"12\" fill=\"#222222\">{}</text>",
        LEFT + plot_w / 2.0,
        bottom + 46.0,
        esc(&c.x_label)
    );
    s.push_str("</svg>\n");
    Some(s)
}

/// The contenders with at least one figure among `cases`, in turn order.
fn present(r: &Results, proxies: &[Proxy], cases: &[String]) -> Vec<Proxy> {
    proxies
        .iter()
        .copied()
        .filter(|p| cases.iter().any(|c| median_of(r, c, p.name()).is_some()))
        .collect()
}

fn series(ps: &[Proxy]) -> Vec<Series> {
    ps.iter()
        .map(|p| Series {
            name: p.label().to_string(),
            color: color(*p),
        })
        .collect()
}

fn group(r: &Results, ps: &[Proxy], label: String, case: &str) -> Group {
    Group {
        label,
        values: ps.iter().map(|p| median_of(r, case, p.name())).collect(),
    }
}

fn rate_label(rate: u32) -> String {
    if rate.is_multiple_of(1000) {
        format!("{}k", rate / 1000)
    } else {
        rate.to_string()
    }
}

/// (a) Added latency (the proxy's percentile minus the direct run's) at each fixed rate.
pub fn latency_chart(r: &Results, proxies: &[Proxy]) -> Chart {
    let mut cases = Vec::new();
    for rate in RATES {
        for pct in ["p50", "p99", "p99.9"] {
            cases.push((
                format!("{pct} @ {} req/s", rate_label(rate)),
                format!("3 latency added {pct} @{rate} rps"),
            ));
        }
    }
    let names: Vec<String> = cases.iter().map(|(_, c)| c.clone()).collect();
    let ps = present(r, proxies, &names);
    Chart {
        title: "Added latency at a fixed request rate (HTTP/1.1 keep-alive)".into(),
        subtitle: "proxy's percentile minus the backend's own, oha with latency correction, \
                   50 connections; median of rounds; lower is better"
            .into(),
        y_label: "added latency, ms".into(),
        x_label: "percentile @ request rate".into(),
        series: series(&ps),
        groups: cases
            .into_iter()
            .map(|(label, case)| group(r, &ps, label, &case))
            .collect(),
        scale: Scale::Log,
    }
}

/// (b) The proxy's CPU seconds per 100,000 requests: at saturation and at each fixed rate.
pub fn cpu_chart(r: &Results, proxies: &[Proxy]) -> Chart {
    let mut cases = vec![(
        "saturation (wrk, 50 conns)".to_string(),
        "4 cpu per 100k requests (h1 run)".to_string(),
    )];
    for rate in RATES {
        cases.push((
            format!("{} req/s", rate_label(rate)),
            format!("4 cpu per 100k requests @{rate} rps"),
        ));
    }
    let names: Vec<String> = cases.iter().map(|(_, c)| c.clone()).collect();
    let ps = present(r, proxies, &names);
    Chart {
        title: "Proxy CPU per 100,000 requests (HTTP/1.1 keep-alive)".into(),
        subtitle: "user + system CPU of the proxy process, one worker on one core; \
                   median of rounds; lower is better"
            .into(),
        y_label: "CPU seconds per 100k requests".into(),
        x_label: "load".into(),
        series: series(&ps),
        groups: cases
            .into_iter()
            .map(|(label, case)| group(r, &ps, label, &case))
            .collect(),
        scale: Scale::Linear,
    }
}

/// (c) Resident memory: idle and after the HTTP/1.1 run (every contender), and with the
/// scale case's config (Portico and Envoy). `None` when the scale case did not run.
pub fn rss_chart(r: &Results, proxies: &[Proxy]) -> Option<Chart> {
    let scale_case = r
        .by_case
        .keys()
        .find(|k| k.starts_with("5 rss with "))?
        .clone();
    // "5 rss with 10000 clusters x10 eps + 10000 routes" -> "10000 clusters x10 eps, 10000 routes".
    let words: Vec<&str> = scale_case.split_whitespace().collect();
    let scale_label = match (words.get(3), words.get(8)) {
        (Some(clusters), Some(routes)) => format!("{clusters} clusters x10 eps, {routes} routes"),
        _ => scale_case.trim_start_matches("5 rss ").to_string(),
    };
    let cases = vec![
        ("idle, 1 route".to_string(), "5 rss idle".to_string()),
        (
            "after the h1 run".to_string(),
            "5 rss after h1 run".to_string(),
        ),
        (scale_label, scale_case),
    ];
    let names: Vec<String> = cases.iter().map(|(_, c)| c.clone()).collect();
    let ps = present(r, proxies, &names);
    Some(Chart {
        title: "Resident memory (RSS)".into(),
        subtitle: "VmRSS of the proxy process; the scale config over ADS (Portico and Envoy \
                   only); median of rounds; lower is better"
            .into(),
        y_label: "RSS, MiB".into(),
        x_label: "configuration".into(),
        series: series(&ps),
        groups: cases
            .into_iter()
            .filter(|(_, case)| ps.iter().any(|p| median_of(r, case, p.name()).is_some()))
            .map(|(label, case)| group(r, &ps, label, &case))
            .collect(),
        scale: Scale::Linear,
    })
}

/// Writes latency.svg, cpu.svg and (with scale figures) rss.svg into `dir`; returns the
/// files written (a chart without data is left out, and an old copy of it removed).
pub fn write_all(r: &Results, proxies: &[Proxy], dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let charts = [
        ("latency.svg", Some(latency_chart(r, proxies))),
        ("cpu.svg", Some(cpu_chart(r, proxies))),
        ("rss.svg", rss_chart(r, proxies)),
    ];
    let mut written = Vec::new();
    for (file, chart) in charts {
        let path = dir.join(file);
        match chart.as_ref().and_then(render) {
            Some(svg) => {
                std::fs::write(&path, svg).map_err(|e| format!("{}: {e}", path.display()))?;
                written.push(path);
            }
            None => {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    Ok(written)
}

/// Copies `files` into `dir` (created if need be), keeping their names.
pub fn publish(files: &[PathBuf], dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for f in files {
        let name = f.file_name().ok_or("no file name")?;
        let to = dir.join(name);
        std::fs::copy(f, &to).map_err(|e| format!("{} -> {}: {e}", f.display(), to.display()))?;
        out.push(to);
    }
    Ok(out)
}

/// Well-formedness, as far as these charts need it: every tag closed in order, attributes
/// quoted, no stray `<` or `&` in text. Returns the element names in document order.
pub fn check_xml(s: &str) -> Result<Vec<String>, String> {
    let mut stack: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find('<') {
        check_text(&rest[..i])?;
        let after = &rest[i + 1..];
        let end = after.find('>').ok_or("unclosed tag")?;
        let tag = &after[..end];
        rest = &after[end + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            match stack.pop() {
                Some(open) if open == name.trim() => {}
                other => return Err(format!("</{name}> closes {other:?}")),
            }
            continue;
        }
        let self_closing = tag.ends_with('/');
        let body = tag.trim_end_matches('/');
        let name: String = body.chars().take_while(|c| !c.is_whitespace()).collect();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(format!("bad tag <{tag}>"));
        }
        if !body.matches('"').count().is_multiple_of(2) {
            return Err(format!("unbalanced quotes in <{tag}>"));
        }
        check_text(&body.replace('"', ""))?;
        if stack.is_empty() && !names.is_empty() {
            return Err(format!("<{name}> after the root element"));
        }
        names.push(name.clone());
        if !self_closing {
            stack.push(name);
        }
    }
    check_text(rest)?;
    if !rest.trim().is_empty() {
        return Err(format!("text after the root: {rest:?}"));
    }
    match stack.last() {
        None => Ok(names),
        Some(open) => Err(format!("<{open}> not closed")),
    }
}

fn check_text(t: &str) -> Result<(), String> {
    let mut rest = t;
    while let Some(i) = rest.find('&') {
        let after = &rest[i + 1..];
        let ok = ["amp;", "lt;", "gt;", "quot;", "apos;"]
            .iter()
            .any(|e| after.starts_with(e));
        if !ok {
            return Err(format!("bare & in {t:?}"));
        }
        rest = after;
    }
    Ok(())
}

/// The numbers in `attr="..."` of every `<rect class="bar" ...>`, in document order.
fn bar_attr(svg: &str, attr: &str) -> Vec<f64> {
    svg.split("<rect class=\"bar\"")
        .skip(1)
        .filter_map(|r| {
            let key = format!(" {attr}=\"");
            let i = r.find(&key)? + key.len();
            r[i..].split('"').next()?.parse().ok()
        })
        .collect()
}

fn two(label: &str, a: Option<f64>, b: Option<f64>) -> Group {
    Group {
        label: label.into(),
        values: vec![a, b],
    }
}

fn sample(scale: Scale, groups: Vec<Group>) -> Chart {
    Chart {
        title: "A <test> & chart".into(),
        subtitle: "sub".into(),
        y_label: "ms".into(),
        x_label: "x".into(),
        series: vec![
            Series {
                name: "Portico".into(),
                color: color(Proxy::Portico),
            },
            Series {
                name: "Envoy \"1.40\"".into(),
                color: color(Proxy::Envoy),
            },
        ],
        groups,
        scale,
    }
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

/// The checks, each with its name: a harness-less bench has no `#[test]`, so `main` runs
/// these under `cargo test --bench vs-envoy` (and with `--self-test`).
pub fn self_test() -> Vec<(&'static str, Result<(), String>)> {
    let mut out: Vec<(&'static str, Result<(), String>)> = Vec::new();

    out.push(("well-formed, escaped, titled", {
        let c = sample(
            Scale::Linear,
            vec![two("a", Some(1.0), Some(2.0)), two("b", Some(3.0), None)],
        );
        render(&c).ok_or("no svg".to_string()).and_then(|svg| {
            ensure(svg.starts_with("<svg "), || {
                "does not start with <svg".into()
            })?;
            ensure(svg.ends_with("</svg>\n"), || {
                "does not end with </svg>".into()
            })?;
            let names = check_xml(&svg)?;
            ensure(names.first().map(String::as_str) == Some("svg"), || {
                "root is not svg".into()
            })?;
            ensure(!names.iter().any(|n| n == "script"), || {
                "has a script".into()
            })?;
            ensure(svg.contains("A &lt;test&gt; &amp; chart"), || {
                "title not escaped".into()
            })?;
            ensure(svg.contains("Envoy &quot;1.40&quot;"), || {
                "legend not escaped".into()
            })?;
            ensure(svg.contains("sans-serif"), || "no sans-serif font".into())?;
            ensure(svg.matches("class=\"swatch\"").count() == 2, || {
                "legend swatches".into()
            })
        })
    }));

    out.push(("one bar per value, none for a missing one", {
        let c = sample(
            Scale::Linear,
            vec![
                two("a", Some(1.0), Some(2.0)),
                two("b", Some(3.0), None),
                two("c", None, Some(0.5)),
            ],
        );
        let svg = render(&c).unwrap_or_default();
        let bars = svg.matches("class=\"bar\"").count();
        let values = svg.matches("class=\"value\"").count();
        ensure(bars == 4 && values == 4, || {
            format!("{bars} bars, {values} value labels, want 4 and 4")
        })
        .and_then(|_| {
            ensure(
                svg.contains(">0.500</text>") && svg.contains(">3.00</text>"),
                || "values not printed on the bars".into(),
            )
        })
    }));

    out.push(("linear: heights proportional to values", {
        let c = sample(
            Scale::Linear,
            vec![
                two("a", Some(1.0), Some(2.0)),
                two("b", Some(4.0), Some(8.0)),
            ],
        );
        let svg = render(&c).unwrap_or_default();
        let h = bar_attr(&svg, "height");
        let y = bar_attr(&svg, "y");
        ensure(h.len() == 4, || format!("{} bars", h.len())).and_then(|_| {
            ensure(
                close(h[1], 2.0 * h[0]) && close(h[2], 4.0 * h[0]) && close(h[3], 8.0 * h[0]),
                || format!("heights {h:?} not 1:2:4:8"),
            )?;
            // Every bar stands on the same baseline.
            let feet: Vec<f64> = y.iter().zip(&h).map(|(y, h)| y + h).collect();
            ensure(feet.iter().all(|f| close(*f, feet[0])), || {
                format!("bars do not share a baseline: {feet:?}")
            })?;
            // The tallest reaches the axis top (8 is a nice maximum), inside the plot.
            ensure(close(h[3], PLOT_H), || {
                format!("tallest bar {} != {PLOT_H}", h[3])
            })
        })
    }));

    out.push(("linear: a negative bar hangs below zero", {
        let c = sample(Scale::Linear, vec![two("a", Some(-1.0), Some(3.0))]);
        let svg = render(&c).unwrap_or_default();
        let h = bar_attr(&svg, "height");
        let y = bar_attr(&svg, "y");
        ensure(h.len() == 2, || format!("{} bars", h.len())).and_then(|_| {
            // The negative bar starts where the positive one ends (at zero).
            ensure(close(y[0], y[1] + h[1]), || {
                format!("negative bar top {} != zero line {}", y[0], y[1] + h[1])
            })?;
            ensure(close(h[1], 3.0 * h[0]), || format!("heights {h:?} not 1:3"))
        })
    }));

    out.push(("log: equal steps per decade; zero gets a label, no bar", {
        let c = sample(
            Scale::Log,
            vec![
                two("a", Some(0.1), Some(1.0)),
                two("b", Some(10.0), Some(0.0)),
            ],
        );
        let svg = render(&c).unwrap_or_default();
        let h = bar_attr(&svg, "height");
        ensure(h.len() == 3, || format!("{} bars, want 3", h.len())).and_then(|_| {
            ensure(close(h[1] - h[0], h[2] - h[1]) && h[0] > 0.0, || {
                format!("heights {h:?} not evenly stepped by decade")
            })?;
            ensure(svg.matches("class=\"value\"").count() == 4, || {
                "the zero value is not labelled".into()
            })?;
            ensure(svg.contains("(log scale)"), || "axis not marked log".into())
        })
    }));

    out.push(("no data, no chart", {
        let c = sample(Scale::Linear, vec![two("a", None, None)]);
        ensure(render(&c).is_none(), || "rendered an empty chart".into())
    }));

    out.push(("nice steps and tick labels", {
        ensure(close(nice_step(10.0, 5), 2.0), || "10/5".into())
            .and_then(|_| ensure(close(nice_step(0.7, 5), 0.2), || "0.7/5".into()))
            .and_then(|_| ensure(close(nice_step(930.0, 5), 200.0), || "930/5".into()))
            .and_then(|_| {
                ensure(fmt_tick(0.30000000000000004) == "0.3", || {
                    fmt_tick(0.30000000000000004)
                })
            })
            .and_then(|_| ensure(fmt_tick(200.0) == "200", || fmt_tick(200.0)))
    }));

    out.push((
        "charts from results: contenders, groups, rss only with scale",
        {
            let mut r = Results::default();
            for (who, v) in [("portico", 1.0), ("envoy", 2.0), ("nginx", 1.5)] {
                r.by_case
                    .entry("4 cpu per 100k requests (h1 run)".into())
                    .or_default()
                    .insert(who.into(), vec![v, v + 0.2]);
            }
            r.by_case
                .entry("5 rss idle".into())
                .or_default()
                .insert("portico".into(), vec![10.0]);
            let c = cpu_chart(&r, &Proxy::ALL);
            let names: Vec<&str> = c.series.iter().map(|s| s.name.as_str()).collect();
            ensure(names == ["Portico", "Envoy 1.40", "nginx"], || {
                format!("series {names:?}")
            })
            .and_then(|_| ensure(c.groups.len() == 1 + RATES.len(), || "cpu groups".into()))
            .and_then(|_| {
                ensure(c.groups[0].values[0].is_some_and(|v| close(v, 1.1)), || {
                    format!("median {:?}", c.groups[0].values[0])
                })
            })
            .and_then(|_| {
                ensure(rss_chart(&r, &Proxy::ALL).is_none(), || {
                    "rss without scale".into()
                })
            })
            .and_then(|_| {
                r.by_case
                    .entry("5 rss with 10 clusters x10 eps + 10 routes".into())
                    .or_default()
                    .insert("envoy".into(), vec![30.0]);
                let c = rss_chart(&r, &Proxy::ALL).ok_or("no rss chart with scale")?;
                ensure(c.groups.len() == 2 && c.series.len() == 2, || {
                    format!("{} groups, {} series", c.groups.len(), c.series.len())
                })?;
                ensure(
                    c.groups[1].label == "10 clusters x10 eps, 10 routes",
                    || format!("scale label {:?}", c.groups[1].label),
                )
            })
            .and_then(|_| {
                let svg = render(&latency_chart(&r, &Proxy::ALL));
                ensure(svg.is_none(), || "latency chart without latency".into())
            })
        },
    ));

    out
}
