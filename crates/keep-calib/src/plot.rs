//! The selection plot: per-layer Jaccard of the chosen set against the frequency set (with the
//! 0.9 kill line) above the per-layer saliency spread; PNG or SVG by the file's extension
//! (plotters; text in the system's sans-serif font through fontconfig).

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::select::{Selection, KILL_JACCARD};
use crate::{CalibError, Result};

/// Image width and height in pixels.
const SIZE: (u32, u32) = (900, 640);

/// Write the plot to `path` (`.png` or `.svg`).
pub fn plot(sel: &Selection, path: &Path) -> Result<()> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let r = match ext.as_str() {
        "svg" => draw(&SVGBackend::new(path, SIZE).into_drawing_area(), sel),
        "png" => draw(&BitMapBackend::new(path, SIZE).into_drawing_area(), sel),
        _ => Err(format!(
            "unknown image type `.{ext}`; name the file *.png or *.svg"
        )),
    };
    r.map_err(|msg| CalibError::Plot {
        path: path.to_path_buf(),
        msg,
    })
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    sel: &Selection,
) -> std::result::Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (top, bottom) = root.split_vertically(SIZE.1 / 2 + 20);
    let nl = sel.layers.len().max(1);
    let x = -0.5f64..(nl as f64 - 0.5);
    let caption = format!(
        "{} vs frequency — keep {} of {} experts; mean Jaccard {}",
        sel.saliency.name(),
        sel.keep,
        sel.n_experts,
        sel.mean_jaccard
            .map(|m| format!("{m:.3}"))
            .unwrap_or_else(|| "n/a".into())
    );
    let mut c = ChartBuilder::on(&top)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(56)
        .build_cartesian_2d(x.clone(), 0f64..1.05)
        .map_err(e)?;
    c.configure_mesh()
        .x_desc("layer")
        .y_desc("Jaccard vs frequency")
        .x_label_formatter(&|v| format!("{}", v.round()))
        .draw()
        .map_err(e)?;
    let kill = RGBColor(200, 40, 40);
    c.draw_series(DashedLineSeries::new(
        vec![(-0.5, KILL_JACCARD), (nl as f64 - 0.5, KILL_JACCARD)],
        3,
        5,
        kill.stroke_width(1),
    ))
    .map_err(e)?
    .label(format!("kill line {KILL_JACCARD}"))
    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], kill));
    let pts: Vec<(f64, f64)> = sel
        .layers
        .iter()
        .filter_map(|l| l.jaccard_vs_frequency.map(|j| (l.layer as f64, j)))
        .collect();
    let blue = RGBColor(31, 119, 180);
    c.draw_series(LineSeries::new(pts.clone(), blue.stroke_width(2)))
        .map_err(e)?
        .label("Jaccard")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue));
    c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, blue.filled())))
        .map_err(e)?;
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(e)?;

    let smax = sel
        .layers
        .iter()
        .map(|l| l.saliency_spread)
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let mut c2 = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x, 0f64..smax)
        .map_err(e)?;
    c2.configure_mesh()
        .x_desc("layer")
        .y_desc("saliency spread (std/mean)")
        .x_label_formatter(&|v| format!("{}", v.round()))
        .draw()
        .map_err(e)?;
    let orange = RGBColor(255, 127, 14);
    let sp: Vec<(f64, f64)> = sel
        .layers
        .iter()
        .filter(|l| !l.hash_routed)
        .map(|l| (l.layer as f64, l.saliency_spread))
        .collect();
    c2.draw_series(LineSeries::new(sp.clone(), orange.stroke_width(2)))
        .map_err(e)?;
    c2.draw_series(sp.iter().map(|&p| Circle::new(p, 4, orange.filled())))
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}
