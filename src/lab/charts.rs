//! The report's charts, drawn with plotters to PNG and SVG from one description. Text uses
//! DejaVu Sans embedded in the binary (`assets/fonts`), so a headless machine with no fonts
//! installed draws the same picture. Legends sit in a column right of the plot area, so they
//! never cover a line; every axis names its quantity and unit.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::analysis::Series;

static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

fn register_font() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| {
        if plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_err() {
            res = Err("the bundled font (assets/fonts/DejaVuSans.ttf) could not be parsed".to_string());
        }
    });
    res
}

/// What one panel of a chart draws.
#[derive(Clone, Debug)]
pub enum PanelKind {
    /// Lines with markers. `log2_x`: x positions are powers of two, drawn evenly spaced.
    /// `ideal`: a dashed reference line with its legend name: y = x / x_min · slope, or y = 1
    /// when slope is 0 (speed-up and efficiency against ideal). `log10_y`: a logarithmic y axis
    /// (values over several decades, as throughput over node counts); `y_from_zero` then does
    /// not apply, and values ≤ 0 are left out.
    Lines { series: Vec<Series>, log2_x: bool, ideal: Option<(String, f64)>, y_percent: bool, y_from_zero: bool, log10_y: bool },
    /// Horizontal stacked bars: one bar per label, one stack part per (name, values).
    StackedBars { labels: Vec<String>, parts: Vec<(String, Vec<f64>)> },
}

#[derive(Clone, Debug)]
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub kind: PanelKind,
}

/// A chart: one or more panels side by side, saved as `<file>.png` and `<file>.svg`.
#[derive(Clone, Debug)]
pub struct Chart {
    pub file: String,
    pub title: String,
    pub panels: Vec<Panel>,
}

const LEGEND_W: u32 = 250;
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// Step parts: forward, backward, exposed comm, data wait, optimizer, other.
const PART_COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(214, 39, 40),
    RGBColor(127, 127, 127),
    RGBColor(44, 160, 44),
    RGBColor(199, 199, 199),
];

impl Chart {
    fn size(&self) -> (u32, u32) {
        let bars = self.panels.iter().map(|p| match &p.kind {
            PanelKind::StackedBars { labels, .. } => labels.len() as u32,
            _ => 0,
        }).max().unwrap_or(0);
        let w = 640 * self.panels.len() as u32 + LEGEND_W;
        let h = if bars > 0 { (130 + 30 * bars).max(360) } else { 480 };
        (w.max(900), h)
    }

    /// Writes `dir/<file>.png` and `dir/<file>.svg`; returns their paths.
    pub fn save(&self, dir: &Path) -> Result<(PathBuf, PathBuf), String> {
        register_font()?;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (w, h) = self.size();
        let png = dir.join(format!("{}.png", self.file));
        let svg = dir.join(format!("{}.svg", self.file));
        let mut buf = vec![0u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
            self.draw(&root)?;
            root.present().map_err(|e| format!("{}: {e}", png.display()))?;
        }
        let img = image::RgbImage::from_raw(w, h, buf).ok_or_else(|| format!("{}: buffer size", png.display()))?;
        img.save(&png).map_err(|e| format!("{}: {e}", png.display()))?;
        let mut text = String::new();
        {
            let root = SVGBackend::with_string(&mut text, (w, h)).into_drawing_area();
            self.draw(&root)?;
            root.present().map_err(|e| format!("{}: {e}", svg.display()))?;
        }
        std::fs::write(&svg, text).map_err(|e| format!("{}: {e}", svg.display()))?;
        Ok((png, svg))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        let e = |x: DrawingAreaErrorKind<DB::ErrorType>| format!("chart {}: {x}", self.file);
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(&self.title, (FAMILY, 24)).map_err(e)?;
        let (w, _) = root.dim_in_pixel();
        let (plots, legend) = root.split_horizontally(w.saturating_sub(LEGEND_W));
        let areas = plots.split_evenly((1, self.panels.len().max(1)));
        let mut entries: Vec<(String, RGBColor, bool)> = Vec::new();
        for (panel, area) in self.panels.iter().zip(areas.iter()) {
            for entry in draw_panel(panel, area).map_err(e)? {
                if !entries.iter().any(|(n, _, _)| *n == entry.0) {
                    entries.push(entry);
                }
            }
        }
        // the legend column
        let mut y = 50;
        for (name, color, dashed) in &entries {
            let x0 = 10;
            if *dashed {
                for k in 0..4 {
                    legend.draw(&PathElement::new(vec![(x0 + k * 8, y), (x0 + k * 8 + 5, y)], color.stroke_width(2))).map_err(e)?;
                }
            } else {
                legend.draw(&Rectangle::new([(x0, y - 6), (x0 + 28, y + 6)], color.filled())).map_err(e)?;
            }
            let shown: String = if name.chars().count() > 26 { format!("{}…", name.chars().take(25).collect::<String>()) } else { name.clone() };
            legend.draw(&Text::new(shown, (x0 + 38, y - 8), (FAMILY, 15))).map_err(e)?;
            y += 24;
        }
        Ok(())
    }
}

/// `x` rounded to a whole number with thousands separators: 10000000 → "10,000,000".
pub fn thousands(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if x < 0.0 && digits.chars().any(|c| c != '0') {
        out.insert(0, '-');
    }
    out
}

/// A tick value of a log axis: three significant digits, thousands separators from 1,000.
fn axis_number(v: f64) -> String {
    if v >= 1000.0 {
        let scale = 10f64.powi(v.log10().floor() as i32 - 2);
        thousands((v / scale).round() * scale)
    } else {
        crate::util::fmt_sig(v, 3)
    }
}

fn nice_max(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    v * 1.1
}

/// A legend entry: name, colour, dashed.
type LegendEntry = (String, RGBColor, bool);

fn draw_panel<DB: DrawingBackend>(p: &Panel, area: &DrawingArea<DB, Shift>) -> Result<Vec<LegendEntry>, DrawingAreaErrorKind<DB::ErrorType>> {
    let mut legend = Vec::new();
    match &p.kind {
        PanelKind::Lines { series, log2_x, ideal, y_percent, y_from_zero, log10_y } => {
            let tx = |x: f64| if *log2_x { x.max(1e-9).log2() } else { x };
            // on a log axis the chart is drawn in log10(y) and labelled in y
            let ty = |y: f64| if *log10_y { y.log10() } else { y };
            let series: Vec<Series> = if *log10_y {
                series.iter().map(|s| Series { name: s.name.clone(), points: s.points.iter().copied().filter(|p| p.1 > 0.0 && p.1.is_finite()).collect() }).collect()
            } else {
                series.clone()
            };
            let series = &series;
            let xs: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| tx(p.0))).collect();
            let mut ys: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).collect();
            let (x0, x1) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
            let (x0, x1) = if xs.is_empty() { (0.0, 1.0) } else if x0 == x1 { (x0 - 1.0, x1 + 1.0) } else { let pad = (x1 - x0) * 0.05; (x0 - pad, x1 + pad) };
            // the ideal line (y = x / x_min · slope, or 1 when slope is 0) must fit too
            if let Some((_, slope)) = ideal {
                let all_x = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
                let (lo, hi) = all_x.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
                if lo < f64::MAX && lo > 0.0 {
                    ys.push(if *slope == 0.0 { 1.0 } else { hi / lo * slope });
                }
            }
            let (ymin, ymax) = if *log10_y {
                let (lo, hi) = ys.iter().filter(|y| **y > 0.0).fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y.log10()), b.max(y.log10())));
                if lo > hi { (0.0, 1.0) } else { let pad = ((hi - lo) * 0.08).max(0.05); (lo - pad, hi + pad) }
            } else {
                let ymax = nice_max(ys.iter().cloned().fold(0.0, f64::max));
                (if *y_from_zero { 0.0 } else { ys.iter().cloned().fold(f64::MAX, f64::min).min(ymax) * 0.9 }, ymax)
            };
            let mut chart = ChartBuilder::on(area)
                .caption(&p.title, (FAMILY, 18))
                .margin(12)
                .x_label_area_size(50)
                .y_label_area_size(80)
                .build_cartesian_2d(x0..x1, ymin..ymax)?;
            // ticks only at whole values (powers of two on a log axis): ranks, batches and
            // stages have no fractional values to label
            let xfmt = |x: &f64| if (x - x.round()).abs() > 0.02 { String::new() } else if *log2_x { format!("{:.0}", 2f64.powf(x.round())) } else { format!("{:.0}", x.round()) };
            let yfmt = |y: &f64| {
                if *log10_y {
                    axis_number(10f64.powf(*y))
                } else if *y_percent {
                    format!("{:.0} %", y * 100.0)
                } else if ymax >= 100.0 {
                    thousands(*y)
                } else if ymax >= 1.0 {
                    format!("{y:.1}")
                } else {
                    format!("{y:.3}")
                }
            };
            // on a log axis about one tick per decade, at whole powers of ten when they fit
            let y_ticks = if *log10_y { ((ymax - ymin).ceil() as usize + 1).clamp(3, 10) } else { 10 };
            let distinct: std::collections::BTreeSet<i64> = xs.iter().map(|x| (x * 1000.0) as i64).collect();
            chart
                .configure_mesh()
                .x_desc(&p.x_label)
                .y_desc(&p.y_label)
                .x_labels(((x1 - x0).ceil() as usize + 1).clamp(2, 12).max(distinct.len()))
                .x_label_formatter(&xfmt)
                .y_labels(y_ticks)
                .y_label_formatter(&yfmt)
                .label_style((FAMILY, 14))
                .axis_desc_style((FAMILY, 16))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()?;
            if let Some((name, slope)) = ideal {
                // ideal against the first point of each series: y = x / x0 (speed-up) or 1 (efficiency)
                let all_x: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
                if let (Some(lo), Some(hi)) = (all_x.iter().cloned().reduce(f64::min), all_x.iter().cloned().reduce(f64::max)) {
                    let pts: Vec<(f64, f64)> = (0..=20).map(|i| lo + (hi - lo) * i as f64 / 20.0).map(|x| (tx(x), ty(if *slope == 0.0 { 1.0 } else { x / lo * slope }))).collect();
                    let black = RGBColor(60, 60, 60);
                    chart.draw_series(DashedLineSeries::new(pts, 6, 4, black.stroke_width(2)))?;
                    legend.push((name.clone(), black, true));
                }
            }
            for (i, s) in series.iter().enumerate() {
                let c = PALETTE[i % PALETTE.len()];
                let pts: Vec<(f64, f64)> = s.points.iter().map(|(x, y)| (tx(*x), ty(*y))).collect();
                chart.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?;
                chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))?;
                legend.push((s.name.clone(), c, false));
            }
        }
        PanelKind::StackedBars { labels, parts } => {
            let n = labels.len();
            let totals: Vec<f64> = (0..n).map(|i| parts.iter().map(|(_, v)| v.get(i).copied().unwrap_or(0.0)).sum()).collect();
            let xmax = nice_max(totals.iter().cloned().fold(0.0, f64::max));
            let label_w = labels.iter().map(|l| l.chars().count()).max().unwrap_or(4) as u32 * 8 + 20;
            let mut chart = ChartBuilder::on(area)
                .caption(&p.title, (FAMILY, 18))
                .margin(12)
                .x_label_area_size(50)
                .y_label_area_size(label_w.clamp(60, 330))
                .build_cartesian_2d(0f64..xmax, (0..n).into_segmented())?;
            let ylabel = |v: &SegmentValue<usize>| match v {
                SegmentValue::CenterOf(i) if *i < n => labels[n - 1 - *i].clone(),
                _ => String::new(),
            };
            chart
                .configure_mesh()
                .x_desc(&p.x_label)
                .y_desc(&p.y_label)
                .y_labels(n)
                .y_label_formatter(&ylabel)
                .disable_y_mesh()
                .label_style((FAMILY, 14))
                .axis_desc_style((FAMILY, 16))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()?;
            let mut starts = vec![0.0; n];
            for (k, (name, vals)) in parts.iter().enumerate() {
                let c = PART_COLORS[k % PART_COLORS.len()];
                chart.draw_series((0..n).map(|i| {
                    let row = n - 1 - i;
                    let v = vals.get(i).copied().unwrap_or(0.0);
                    let (a, b) = (starts[i], starts[i] + v);
                    starts[i] = b;
                    let mut r = Rectangle::new([(a, SegmentValue::Exact(row)), (b, SegmentValue::Exact(row + 1))], c.filled());
                    r.set_margin(4, 4, 0, 0);
                    r
                }))?;
                legend.push((name.clone(), c, false));
            }
        }
    }
    Ok(legend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_numbers_have_thousands_separators() {
        assert_eq!(thousands(10_000_000.0), "10,000,000");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1234.0), "1,234");
        assert_eq!(thousands(-1234567.0), "-1,234,567");
        assert_eq!(axis_number(1e7), "10,000,000");
        assert_eq!(axis_number(10f64.powf(3.2)), "1,580");
        assert_eq!(axis_number(31.62), "31.6");
    }
}
