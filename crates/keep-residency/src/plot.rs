//! The report's plot: miss rate against hot-set size, one line per policy (Belady, the ceiling,
//! dashed), with the 5% kill line; PNG or SVG by the file's extension (plotters).
//!
//! The x axis is logarithmic when every size is at least 1 and they span a factor of 4 or more
//! (the usual geometric sweep), linear otherwise. Text uses the system's sans-serif font
//! (fontconfig), as plotters does.

use std::path::Path;

use plotters::coord::combinators::LogCoord;
use plotters::coord::ranged1d::{Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::policy::PolicyKind;
use crate::report::{Report, KILL_MISS_RATE};
use crate::{ResidencyError, Result};

/// Image width and height in pixels.
const SIZE: (u32, u32) = (900, 560);

fn color(p: PolicyKind) -> RGBColor {
    match p {
        PolicyKind::Static => RGBColor(31, 119, 180),
        PolicyKind::Lru => RGBColor(44, 160, 44),
        PolicyKind::Decay => RGBColor(255, 127, 14),
        PolicyKind::Belady => RGBColor(80, 80, 80),
    }
}

/// Write the plot to `path` (`.png` or `.svg`).
pub fn plot(report: &Report, path: &Path) -> Result<()> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let err = |msg: String| ResidencyError::Plot {
        path: path.to_path_buf(),
        msg,
    };
    if report.sizes.is_empty() {
        return Err(err("no hot-set sizes to plot".into()));
    }
    let hots: Vec<f64> = report.sizes.iter().map(|s| s.hot as f64).collect();
    let lo = hots.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = hots.iter().copied().fold(0.0, f64::max);
    let log = lo >= 1.0 && hi / lo >= 4.0;
    let (xa, xb) = if log {
        (lo / 1.15, hi * 1.15)
    } else if hi > lo {
        let pad = (hi - lo) * 0.05;
        (lo - pad, hi + pad)
    } else {
        (lo - 1.0, hi + 1.0)
    };
    match ext.as_str() {
        "svg" => {
            let root = SVGBackend::new(path, SIZE).into_drawing_area();
            if log {
                draw::<_, LogCoord<f64>>(&root, report, (xa..xb).log_scale().into())
            } else {
                draw::<_, RangedCoordf64>(&root, report, (xa..xb).into())
            }
        }
        "png" => {
            let root = BitMapBackend::new(path, SIZE).into_drawing_area();
            if log {
                draw::<_, LogCoord<f64>>(&root, report, (xa..xb).log_scale().into())
            } else {
                draw::<_, RangedCoordf64>(&root, report, (xa..xb).into())
            }
        }
        _ => Err(format!(
            "unknown image type `.{ext}`; name the file *.png or *.svg"
        )),
    }
    .map_err(err)
}

fn draw<DB, X>(
    root: &DrawingArea<DB, Shift>,
    report: &Report,
    x: X,
) -> std::result::Result<(), String>
where
    DB: DrawingBackend,
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let ymax = report
        .sizes
        .iter()
        .flat_map(|s| s.policies.iter().map(|p| p.miss_rate))
        .fold(KILL_MISS_RATE * 1.5, f64::max)
        * 1.08;
    let caption = format!(
        "expert misses vs hot-set size — {} sessions, {} layers, {} experts, top-{}",
        report.inputs.sessions.len(),
        report.inputs.layers.len(),
        report.inputs.n_experts,
        report.inputs.top_k
    );
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(x, 0f64..ymax)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("hot experts per layer")
        .y_desc("miss rate (SSD reads / routed slot)")
        .x_label_formatter(&|v| format!("{}", v.round()))
        .y_label_formatter(&|v| format!("{:.0}%", v * 100.0))
        .draw()
        .map_err(e)?;
    let xs: Vec<f64> = report.sizes.iter().map(|s| s.hot as f64).collect();
    let x0 = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let x1 = xs.iter().copied().fold(0.0, f64::max);
    let kill = RGBColor(200, 40, 40);
    chart
        .draw_series(DashedLineSeries::new(
            vec![(x0, KILL_MISS_RATE), (x1, KILL_MISS_RATE)],
            3,
            5,
            kill.stroke_width(1),
        ))
        .map_err(e)?
        .label("5% kill line")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], kill));
    for &p in &report.inputs.policies {
        let pts: Vec<(f64, f64)> = report
            .sizes
            .iter()
            .filter_map(|s| {
                s.policies
                    .iter()
                    .find(|r| r.policy == p)
                    .map(|r| (s.hot as f64, r.miss_rate))
            })
            .collect();
        let c = color(p);
        let style = c.stroke_width(2);
        if p == PolicyKind::Belady {
            chart
                .draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))
                .map_err(e)?
                .label("belady (ceiling)")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 8, y)], c.stroke_width(2))
                });
        } else {
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(e)?
                .label(p.name())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        chart
            .draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y), 3, c.filled())))
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}
