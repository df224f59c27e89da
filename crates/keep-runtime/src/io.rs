//! A small fixed pool of I/O threads fed through a channel. Plain std threads rather than
//! rayon's pool: the reads block in the kernel, and rayon's workers are the compute threads of
//! the kernels — a blocked read there would take a core away from the matmuls it is meant to
//! overlap with. Several reads in flight at once are what an SSD needs to reach its bandwidth.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Default number of I/O threads.
pub const DEFAULT_IO_THREADS: usize = 8;

/// A fixed pool of threads that run submitted jobs in order of submission.
pub struct IoPool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl IoPool {
    /// Start `n` (at least 1) threads named `keep-io-{i}`.
    pub fn new(n: usize) -> std::io::Result<IoPool> {
        let (tx, rx) = channel::<Job>();
        let rx: Arc<Mutex<Receiver<Job>>> = Arc::new(Mutex::new(rx));
        let mut threads = vec![];
        for i in 0..n.max(1) {
            let rx = rx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("keep-io-{i}"))
                    .stack_size(256 * 1024)
                    .spawn(move || loop {
                        let job = match rx.lock() {
                            Ok(r) => r.recv(),
                            Err(_) => return,
                        };
                        match job {
                            Ok(f) => f(),
                            Err(_) => return,
                        }
                    })?,
            );
        }
        Ok(IoPool {
            tx: Some(tx),
            threads,
        })
    }

    /// Number of threads.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Queue a job; false if the pool has shut down (the job is dropped unrun).
    pub fn submit(&self, f: impl FnOnce() + Send + 'static) -> bool {
        match &self.tx {
            Some(tx) => tx.send(Box::new(f)).is_ok(),
            None => false,
        }
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
