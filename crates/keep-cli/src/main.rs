//! `keep`: the command-line glue over keep's libraries.
//!
//! What it is: argument parsing (clap), progress bars, tables and JSON printing, exit codes.
//! What it is not: any logic a library could hold — each verb calls one library entry point.
//! The only crate with `anyhow` and `clap`.

mod bundled;
mod cmd;
mod util;

use clap::{Parser, Subcommand};

/// keep: run and shrink Mixture-of-Experts models far larger than memory.
#[derive(Parser)]
#[command(name = "keep", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Synth(cmd::synth::SynthArgs),
    Inspect(cmd::inspect::InspectArgs),
    Repack(cmd::repack::RepackArgs),
    Verify(cmd::verify::VerifyArgs),
    Logits(cmd::logits::LogitsArgs),
    Run(cmd::run::RunArgs),
    Bench(cmd::bench::BenchArgs),
    Prune(cmd::prune::PruneArgs),
    Sidecar(cmd::sidecar::SidecarArgs),
    Eval(cmd::eval::EvalArgs),
    Residency(cmd::residency::ResidencyArgs),
    Pack(cmd::pack::PackArgs),
    Calibrate(cmd::calibrate::CalibrateArgs),
    Finalize(cmd::finalize::FinalizeArgs),
    Select(cmd::select::SelectArgs),
    Quant(cmd::quant::QuantArgs),
    Serve(cmd::serve::ServeArgs),
    ChatTemplate(cmd::chat_template::ChatTemplateArgs),
    Alloc(cmd::alloc::AllocArgs),
    AllocFit(cmd::alloc::AllocFitArgs),
    Fit(cmd::fit::FitArgs),
}

fn main() {
    // Die quietly on a closed pipe (`keep inspect | head`) like other Unix tools.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of a signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Synth(a) => cmd::synth::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Repack(a) => cmd::repack::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Logits(a) => cmd::logits::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Prune(a) => cmd::prune::run(a),
        Command::Sidecar(a) => cmd::sidecar::run(a),
        Command::Eval(a) => cmd::eval::run(a),
        Command::Residency(a) => cmd::residency::run(a),
        Command::Pack(a) => cmd::pack::run(a),
        Command::Calibrate(a) => cmd::calibrate::run(a),
        Command::Finalize(a) => cmd::finalize::run(a),
        Command::Quant(a) => cmd::quant::run(a),
        Command::Select(a) => cmd::select::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::ChatTemplate(a) => cmd::chat_template::run(a),
        Command::Alloc(a) => cmd::alloc::run(a),
        Command::AllocFit(a) => cmd::alloc::run_fit(a),
        Command::Fit(a) => cmd::fit::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    /// clap's own consistency checks over every verb (argument order, conflicts, help).
    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
