//! SVG plots of `bench run` records (plotters): the drive ladder (TTFT and decode rate against the
//! number of drives) and the per-layer read wait of each run.

use anyhow::{Result, anyhow};
use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

fn label(r: &Value) -> String {
    let drives = r["drives_used"].as_array().map_or("all drives".to_string(), |d| format!("{} drive(s)", d.len()));
    format!("{drives}, prefetch {}", if r["prefetch"].as_bool() == Some(true) { "on" } else { "off" })
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("plotting failed: {e}")
}

/// TTFT and decode tokens/s against drives used, one line per prefetch setting.
pub fn ladder(path: &Path, records: &[Value]) -> Result<()> {
    let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(480);
    let x_of = |r: &Value| r["drives_used"].as_array().map_or(1, |d| d.len()) as i32;
    let max_x = records.iter().map(x_of).max().unwrap_or(1).max(1);
    for (area, key, title) in [(&left, "ttft_s", "TTFT (s)"), (&right, "decode_tok_s", "decode tokens/s")] {
        let val = |r: &Value| if key == "ttft_s" { r["ttft_s"].as_f64() } else { r["decode"]["decode_tok_s"].as_f64() };
        let max_y = records.iter().filter_map(val).fold(0.0f64, f64::max).max(1e-9) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(32)
            .y_label_area_size(48)
            .build_cartesian_2d(0i32..max_x + 1, 0f64..max_y)
            .map_err(err)?;
        chart.configure_mesh().x_desc("drives").disable_x_mesh().draw().map_err(err)?;
        for (i, pf) in [false, true].into_iter().enumerate() {
            let pts: Vec<(i32, f64)> = records
                .iter()
                .filter(|r| r["prefetch"].as_bool() == Some(pf))
                .filter_map(|r| val(r).map(|v| (x_of(r), v)))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(format!("prefetch {}", if pf { "on" } else { "off" }))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(err)?;
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Seconds the compute waited for reads, per MoE layer, one line per run.
pub fn read_wait(path: &Path, records: &[Value]) -> Result<()> {
    let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let series: Vec<(String, Vec<(i32, f64)>)> = records
        .iter()
        .map(|r| {
            let pts = r["stats"]["layer_read_wait_s"]
                .as_array()
                .map(|a| {
                    a.iter().filter_map(|x| Some((x["layer"].as_i64()? as i32, x["read_wait_s"].as_f64()?))).collect()
                })
                .unwrap_or_default();
            (label(r), pts)
        })
        .collect();
    let max_x = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).max().unwrap_or(1);
    let max_y = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(0.0f64, f64::max).max(1e-9) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption("read wait per MoE layer (prefill + decode)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(56)
        .build_cartesian_2d(0i32..max_x + 1, 0f64..max_y)
        .map_err(err)?;
    chart.configure_mesh().x_desc("layer").y_desc("seconds").draw().map_err(err)?;
    for (i, (name, pts)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
