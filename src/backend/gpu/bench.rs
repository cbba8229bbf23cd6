//! Timing of the product kernels for `bench kernels --backend gpu`: a product with its weights
//! resident, and a plain read of the same bytes for comparison.
//!
//! Contract: both are timed as `reps` dispatches in one submission, ended by a one-float readback,
//! after one untimed warm-up submission. The plain read (`read_all` in `kernels/matvec.wgsl`) loads
//! the weight and scale buffers with the matvec kernel's access width (one u32 per thread per load, four
//! loads in flight), consecutive threads on consecutive words, about 64 words per thread, and
//! writes one partial per thread (under 2% of the bytes read).

use super::BenchKind;
use super::device::{Gpu, Kind};
use crate::cpu::{Bf16Mat, Mxfp4Mat};
use std::time::Instant;

/// Words each thread of the plain read covers (the grid is sized from it).
const WORDS_PER_THREAD: u64 = 64;

impl Gpu {
    /// Seconds per product dispatch (weights resident, `n` input rows) and per
    /// plain read of the same weight bytes, each averaged over `reps` dispatches.
    pub fn time_product(&self, kind: BenchKind, rows: usize, cols: usize, n: usize, reps: usize) -> (f64, f64) {
        let mut seed = 7u64;
        let mut byte = || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) as u8
        };
        let (r, k) = match kind {
            BenchKind::Bf16 => {
                // Normal values of moderate size (random bits would include NaNs and denormals).
                let b: Vec<u8> = (0..rows * cols).flat_map(|_| [byte(), (byte() & 0x80) | 0x3d]).collect();
                (self.upload_bf16(&Bf16Mat::from_vec(b, rows, cols)), Kind::Bf16)
            }
            BenchKind::Mxfp4 => {
                let packed: Vec<u8> = (0..rows * cols / 2).map(|_| byte()).collect();
                let scales = vec![121u8; rows * cols / 32];
                (self.upload_mxfp4(&Mxfp4Mat::new(&packed, &scales, rows, cols), true), Kind::Mxfp4)
            }
        };
        let xs: Vec<f32> = (0..n * cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
        let x = self.storage("x", &Gpu::input_bytes(&xs, cols, r.stride));
        let o = self.output(n * rows);
        let run = |reps: usize| {
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("product"),
                    timestamp_writes: None,
                });
                for _ in 0..reps {
                    self.encode_products(&mut pass, &r, k, &x, 0, &o, 0, n);
                }
            }
            let t = Instant::now();
            self.finish(enc, &o, 1);
            t.elapsed().as_secs_f64()
        };
        run(1);
        let product = run(reps) / reps as f64;
        // Each buffer (an MXFP4 chunk's weights and its scales) is read by its own dispatch, sized
        // for its words.
        let bufs: Vec<&wgpu::Buffer> =
            r.chunks.iter().flat_map(|c| if k == Kind::Mxfp4 { vec![&c.w, &c.scales] } else { vec![&c.w] }).collect();
        let groups: Vec<(wgpu::BindGroup, u32)> = bufs
            .into_iter()
            .map(|b| {
                let words = b.size() / 4;
                let wgs = words.div_ceil(256 * WORDS_PER_THREAD).clamp(1, 65_535) as u32;
                let partial = self.output(wgs as usize * 256);
                let p = self.uniform(Default::default());
                (self.bind(b, b, &x, &partial, &p), wgs)
            })
            .collect();
        let read = |reps: usize| {
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            {
                let mut pass = enc
                    .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("read"), timestamp_writes: None });
                pass.set_pipeline(&self.read_all);
                for _ in 0..reps {
                    for (bg, wgs) in &groups {
                        pass.set_bind_group(0, bg, &[]);
                        pass.dispatch_workgroups(*wgs, 1, 1);
                    }
                }
            }
            let t = Instant::now();
            self.finish(enc, &o, 1);
            t.elapsed().as_secs_f64()
        };
        read(1);
        (product, read(reps) / reps as f64)
    }
}
