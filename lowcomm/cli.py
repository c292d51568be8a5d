"""The `lowcomm` command line: argument parsing only; the work happens in lowcomm.runtime."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from lowcomm.version import __version__
from lowcomm.config import ALGOS, ConfigError, load_config
from lowcomm.collectives.allocator import tune_allocator
from lowcomm.runtime.options import PeerOptions, peer_options, read_profile


def _add_coordinator(sub) -> None:
    coordinator = sub.add_parser("coordinator", help="the run owner's node").add_subparsers(dest="action", required=True)
    start = coordinator.add_parser("start", help="start the first DHT node, publish the signed run config")
    start.add_argument("--config", type=Path, help="run config (TOML); defaults to the embedded default run")
    start.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0, every "
                       "interface; the join command carries this machine's primary address)")
    start.add_argument("--port", type=int, default=0, help="data plane (gRPC) port, which peers dial for their "
                       "reachability check (default: 0, any free one)")
    start.add_argument("--dht-port", type=int, default=0, help="DHT (p2pd) port, the one in the join command "
                       "(default: 0, any free one; fix it to open it in a firewall)")
    start.add_argument("--dht-host", help="address the DHT (p2pd) listens on (default: --host)")
    start.add_argument("--announce-addr", metavar="HOST[:PORT]", help="the address peers dial, for both planes "
                       "(behind NAT with forwarded ports, or a proxy); PORT is the data plane's")
    _add_dashboard(start)
    start.add_argument("--run-dir", type=Path, default=Path("runs/coordinator"),
                       help="where the coordinator keeps its key and checkpoints")
    start.add_argument("--resume", type=Path, help="restart the swarm from a checkpoint folder")
    start.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    token = coordinator.add_parser("token", help="print a join token for one peer of a token run (run.mode = \"token\")")
    token.add_argument("--peer-id", required=True, help="the peer's id, as its `lowcomm peer id --key-file PATH` prints")
    token.add_argument("--run-dir", type=Path, default=Path("runs/coordinator"),
                       help="the coordinator's --run-dir, which holds its key (default: runs/coordinator)")
    token.add_argument("--config", type=Path, help="the run config the coordinator runs (its run.name); default: the "
                       "embedded default run")
    token.add_argument("--valid-days", type=float, default=30.0, help="how long the token admits the peer (default: 30)")


def _add_dashboard(parser) -> None:
    parser.add_argument("--dashboard-port", type=int, default=None, metavar="P", help="serve the run's status page "
                        "at http://HOST:P/, its JSON at /api/status and Prometheus metrics at /metrics (default: none)")
    parser.add_argument("--dashboard-host", default="127.0.0.1", metavar="HOST", help="where the status page "
                        "listens (default: 127.0.0.1, this machine only; 0.0.0.0 for every interface)")


def _add_observe(sub) -> None:
    observe = sub.add_parser("observe", help="watch a run from anywhere: the status page and /metrics, read from "
                             "the DHT (a read-only node that trains nothing)")
    observe.add_argument("--coordinator", required=True, action="append", metavar="MULTIADDR",
                         help="multiaddr of the coordinator or any peer (repeat it for several)")
    observe.add_argument("--run", default="lowcomm-default", help="run name, from the join command")
    _add_dashboard(observe)
    observe.set_defaults(dashboard_port=8080)


def _add_peer(sub) -> None:
    peer = sub.add_parser("peer", help="a volunteer peer").add_subparsers(dest="action", required=True)
    join = peer.add_parser("join", help="join a run and train", description=(
        "Every option can also come from a peer profile (--config peer.toml, a [peer] table whose keys are the "
        "option names with underscores, e.g. run_key, client_mode); the flags given override it. Ready profiles "
        "are in the project's peers/ folder."))
    default = {f.name: f.default for f in dataclasses.fields(PeerOptions)}
    # Every default is None here: a flag left out keeps what the profile (or PeerOptions) says.
    join.add_argument("--coordinator", action="append", metavar="MULTIADDR", help="multiaddr of the coordinator or any peer (required, "
                      "here or in the profile; repeat it for several)")
    join.add_argument("--run-key", metavar="KEY", help="the coordinator's public key, from its join command (required, here or in "
                      "the profile)")
    join.add_argument("--run", dest="run_name", metavar="NAME", help=f"run name, from the join command (default: {default['run_name']})")
    join.add_argument("--device", metavar="auto|cpu|cuda[:N]", help=f"what to train on (default: {default['device']}: "
                      "a GPU if torch sees one)")
    join.add_argument("--config", type=Path, metavar="PEER.TOML", help="peer profile (TOML): a [peer] table of these options; flags "
                      "override it (see peers/*.toml)")
    join.add_argument("--host", help=f"address to listen on (default: {default['host']}, every interface; "
                      "this machine's primary address is announced)")
    join.add_argument("--port", type=int, help=f"data plane (gRPC) port (default: {default['port']}, any free one)")
    join.add_argument("--dht-port", type=int, help=f"DHT (p2pd) port (default: {default['dht_port']}, any free one; "
                      "fix it to open it in a firewall)")
    join.add_argument("--dht-host", help="address the DHT (p2pd) listens on (default: --host)")
    join.add_argument("--announce-addr", metavar="HOST[:PORT]", help="the address other peers dial, for both "
                      "planes (behind NAT with forwarded ports, or a proxy); PORT is the data plane's")
    join.add_argument("--client-mode", action=argparse.BooleanOptionalAction,
                      help="contribute without serving (for peers others cannot dial); detected if not given")
    join.add_argument("--data-shard", type=int, help="which data shard to read (default: from the peer id)")
    join.add_argument("--num-shards", type=int, help=f"how many shards the training data is cut into (default: "
                      f"{default['num_shards']})")
    join.add_argument("--run-dir", type=Path, help="where to append this peer's JSONL records "
                      "(default: runs/RUN; they go to RUN_DIR/peers/PEER.jsonl)")
    join.add_argument("--link", metavar="RATE[:LATENCY]",
                      help="emulate this access link for all data-plane traffic, e.g. 20mbit:80ms, or "
                           "unlimited:80ms for latency only (default: none)")
    join.add_argument("--stage", type=int, help="pipelined runs: serve this stage from the run's initial weights "
                      "(simulate's initial placement; default: the stage that needs a newcomer most)")
    join.add_argument("--slowdown", type=float, help=argparse.SUPPRESS)  # emulates a slower device
    join.add_argument("--slowdown-file", type=Path, help=argparse.SUPPRESS)  # ... from when simulate writes it
    join.add_argument("--fault", help=argparse.SUPPRESS)
    join.add_argument("--byzantine", metavar="KIND", help=argparse.SUPPRESS)  # runtime.byzantine
    join.add_argument("--start-file", type=Path, help=argparse.SUPPRESS)
    join.add_argument("--key-file", type=Path, metavar="PATH", help="this peer's key, made there if missing: a stable "
                      "peer id, which allowlist and token runs need (default: a new key and id at every start)")
    join.add_argument("--token", help="token runs: the join token the run owner printed for this peer's id")
    join.add_argument("--metrics-port", type=int, metavar="P", help="serve this peer's Prometheus metrics at "
                      "http://METRICS_HOST:P/metrics (default: not served; 0: any free port)")
    join.add_argument("--metrics-host", metavar="HOST", help=f"where /metrics listens (default: "
                      f"{default['metrics_host']}; 0.0.0.0 for a scraper on another machine)")
    join.add_argument("--join-unadmitted", action="store_const", const=True, help=argparse.SUPPRESS)  # a test hook
    ident = peer.add_parser("id", help="print this peer's id (from its key file, made if missing), for the run owner")
    ident.add_argument("--key-file", type=Path, required=True, metavar="PATH", help="the key file to pass to peer join")


def _add_simulate(sub) -> None:
    simulate = sub.add_parser("simulate", help="a coordinator and N peers as local processes")
    simulate.add_argument("--config", type=Path, help="run config (TOML); defaults to the embedded default run")
    simulate.add_argument("--peers", type=int, default=4)
    simulate.add_argument("--algo", choices=list(ALGOS), help="overrides run.algo")
    simulate.add_argument("--steps", type=int, help="inner steps per peer (overrides run.steps)")
    simulate.add_argument("--seed", type=int, help="overrides run.seed")
    simulate.add_argument("--inner-steps", type=int, help="H of the chosen algorithm (diloco.inner_steps, also "
                          "Streaming DiLoCo's, sparseloco.inner_steps or noloco.inner_steps)")
    simulate.add_argument("--codec", choices=["fp32", "uint8", "fp8"],
                          help="payload codec: diloco.codec (fp32 | uint8) or, for streaming-diloco, streaming.codec")
    simulate.add_argument("--fragments", type=int, help="Streaming DiLoCo's P (overrides streaming.fragments)")
    simulate.add_argument("--overlap", action="store_true", default=None,
                          help="DiLoCo and SparseLoCo: one-step-delay overlap, compute does not wait for the "
                               "reduce; DeMo: each step's update lands one step late (overrides diloco.overlap, "
                               "sparseloco.overlap and demo.overlap)")
    simulate.add_argument("--report", type=Path, default=Path("runs/report.json"),
                          help="where the report goes (default: runs/report.json; runs/ is ignored by git)")
    simulate.add_argument("--run-dir", type=Path, help="folder for logs and peer records (default: beside the report)")
    simulate.add_argument("--link", metavar="RATE[:LATENCY]",
                          help="every peer's emulated link, e.g. 100mbit:40ms or none (overrides link.default; "
                               "[link.peers] exceptions still apply)")
    simulate.add_argument("--churn", metavar="SPEC",
                          help="inject churn: a schedule such as kill:1@r3,leave:1@r4,join:2@t30s (at round rN or "
                               "N seconds tNs), also slow:1:4x@r5 (a peer 4x slower from then on), "
                               "linkdown:1:15s@r6 (--netns: a peer's link down 15 s) and kill:all@r9 (every peer "
                               "and the coordinator), or a rate such as 0.25/round (overrides churn.spec; none "
                               "disables)")
    simulate.add_argument("--resume", type=Path, metavar="DIR", help="the coordinator restarts the swarm from this "
                          "checkpoint folder (a run dir's checkpoints/, e.g. after kill:all)")
    simulate.add_argument("--byzantine", metavar="KIND:N[,KIND:N]",
                          help="make N of the peers Byzantine members that lie on the wire as KIND: sign-flip, "
                               "scale, noise, constant, nan, inflate-weight, copy or replay (docs/simulation.md); "
                               "the report's final_loss is then the honest peers'")
    simulate.add_argument("--mode", choices=["open", "allowlist", "token"], help="who may join (overrides run.mode): "
                          "in allowlist and token runs the launcher makes each peer's key and lists it or signs its "
                          "token")
    simulate.add_argument("--stages", type=int, help="cut the model into S pipeline stages, each served by "
                          "changing sets of peers (overrides pipeline.stages; churn adds killstage:S@rR)")
    simulate.add_argument("--netns", action="store_true", default=None,
                          help="Linux, root: each process in its own network namespace; the RATE of --link "
                               "becomes a kernel htb cap on every byte (DHT included), LATENCY stays in lowcomm's "
                               "shaper; the report adds wire_bytes and control_bytes (overrides link.netns)")
    _add_dashboard(simulate)


def _add_status(sub) -> None:
    status = sub.add_parser("status", help="list the live peers and latest rounds from the DHT")
    status.add_argument("--coordinator", required=True, action="append")
    status.add_argument("--run", default="lowcomm-default")


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="write the trained model of a checkpoint: safetensors + its config")
    export.add_argument("checkpoint", type=Path, help="a coordinator's checkpoints folder, or one round-NNNNNN folder")
    export.add_argument("out", type=Path, help="folder for model.safetensors and config.json")
    export.add_argument("--config", type=Path, help="the run's config (TOML), for a checkpoint without config.json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowcomm", description="Low-communication decentralized training.")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_coordinator(sub)
    _add_peer(sub)
    _add_simulate(sub)
    _add_status(sub)
    _add_observe(sub)
    _add_export(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    tune_allocator()  # before any thread starts
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        actions = {("coordinator", "token"): coordinator_token, ("peer", "id"): peer_id}
        return actions.get((args.command, getattr(args, "action", None)), {
            "coordinator": coordinator_start, "peer": peer_join, "simulate": simulate, "status": status,
            "observe": observe, "export": export}[args.command])(args)
    except ConfigError as e:
        print(f"lowcomm: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line a person can act on; -v shows where it came from
        if args.verbose:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"lowcomm {args.command}: {type(e).__name__}: {first} (add -v after lowcomm for the traceback)",
              file=sys.stderr)
        return 1


def coordinator_start(args) -> int:
    from lowcomm.runtime.coordinator import Coordinator
    from lowcomm.runtime.preflight import check_coordinator

    config = load_config(args.config)
    check_coordinator(args)  # before the key or the run dir is written
    coordinator = Coordinator(config, args.run_dir, args.host, args.port, args.resume, args.ready_file,
                              dht_host=args.dht_host, dht_port=args.dht_port, announce=args.announce_addr)
    info = coordinator.start()
    print(f"coordinator of run {info['run']} is up (config {info['config_hash']}"
          + (f", resumed at round {info['resumed_round']}" if info["resumed_round"] is not None else "") + ")")
    print("peers join with:\n  " + info["join_command"], flush=True)
    page = _status_page(args, lambda page: page.for_dht(coordinator.control, config.run.name, args.dashboard_host,
                                                        args.dashboard_port))
    try:
        coordinator.serve_forever()
    finally:
        if page is not None:
            page.close()
    return 0


def _status_page(args, start):
    """The status page `start(StatusPage)` opens, if --dashboard-port was given; its URL printed."""
    if args.dashboard_port is None:
        return None
    from lowcomm.runtime.dashboard import StatusPage

    try:
        page = start(StatusPage)
    except OSError as e:
        raise ConfigError(f"--dashboard-port: {e}") from None
    print(f"status page at {page.url} (JSON at {page.url}api/status, Prometheus at {page.url}metrics)",
          file=sys.stderr, flush=True)
    return page


def observe(args) -> int:
    from lowcomm.runtime.preflight import check_dashboard, check_multiaddrs
    from lowcomm.runtime.watch import observe_until_stopped

    check_multiaddrs(args.coordinator)
    check_dashboard(args)
    return observe_until_stopped(args.coordinator, args.run, lambda control: _status_page(
        args, lambda page: page.for_dht(control, args.run, args.dashboard_host, args.dashboard_port)))


def coordinator_token(args) -> int:
    from lowcomm.runtime.admission import coordinator_token as issue

    config = load_config(args.config)
    print(issue(args.run_dir, config.run, args.peer_id.strip(), args.valid_days))
    if config.run.mode != "token":
        print(f"note: run {config.run.name!r} has run.mode = {config.run.mode!r}; tokens count once it is \"token\"",
              file=sys.stderr)
    return 0


def peer_id(args) -> int:
    from lowcomm.runtime.admission import load_key

    print(load_key(args.key_file).peer_id)
    return 0


def peer_join(args) -> int:
    from lowcomm.runtime.faults import FaultPlan
    from lowcomm.runtime.peer import Peer
    from lowcomm.runtime.preflight import check_peer

    options = peer_options_of(args)
    try:
        FaultPlan.parse(options.fault)
    except ValueError as e:
        raise ConfigError(f"--fault: {e}") from None
    if options.byzantine:
        from lowcomm.runtime.byzantine import Kind
        Kind.parse(options.byzantine)
    check_peer(options)  # before the DHT is joined
    if options.run_dir is None:  # the records go somewhere a person finds them, ignored by git
        options = dataclasses.replace(options, run_dir=Path("runs") / options.run_name)
    return Peer(options).run()


def peer_options_of(args) -> PeerOptions:
    """The profile's [peer] table (--config), overridden by the flags given (those not None)."""
    profile = read_profile(args.config) if args.config is not None else {}
    return peer_options(profile, {f.name: getattr(args, f.name) for f in dataclasses.fields(PeerOptions)})


def simulate(args) -> int:
    from lowcomm.runtime.byzantine import parse_byzantine
    from lowcomm.runtime.churn import parse_churn
    from lowcomm.runtime.sim import Simulation, SimulationError
    from lowcomm.runtime.sim_admission import admit_simulated
    from lowcomm.runtime.preflight import check_dashboard
    from lowcomm.transport.netns import NetnsError, NetnsUnavailable

    if args.peers < 1:
        raise ConfigError(f"--peers {args.peers}: a simulation needs at least 1 peer")
    check_dashboard(args)
    config = load_config(args.config).override({"run.algo": args.algo, "pipeline.stages": args.stages})
    inner_steps_key = (f"{config.run.algo}.inner_steps" if config.run.algo in ("sparseloco", "noloco")
                       else "diloco.inner_steps")
    codec_key = "streaming.codec" if config.streaming_run else "diloco.codec"
    config = config.override({"run.steps": args.steps,
                              "run.seed": args.seed, inner_steps_key: args.inner_steps,
                              codec_key: args.codec, "streaming.fragments": args.fragments, "link.default": args.link,
                              "churn.spec": args.churn, "link.netns": args.netns,
                              "diloco.overlap": args.overlap, "sparseloco.overlap": args.overlap,
                              "demo.overlap": args.overlap})
    run_dir = args.run_dir or args.report.with_suffix("").with_name(args.report.stem + "-run")
    links = sorted({config.link.spec_for(i) or "unshaped" for i in range(args.peers)})
    churn = f", churn {parse_churn(config.churn.spec)}" if parse_churn(config.churn.spec) else ""
    mode = " in network namespaces (htb caps)" if config.link.netns else ""
    stages = f" in {config.pipeline.stages} pipeline stages" if config.pipelined else ""
    byzantine = parse_byzantine(args.byzantine, args.peers)
    plan = parse_churn(config.churn.spec)
    joiners = (sum(a.count for a in plan.actions if a.action == "join") if plan.rate is None else 2 * args.peers) \
        if plan else 0
    config, peer_flags = admit_simulated(config, args.mode, run_dir, args.peers + joiners)
    if args.resume is not None:
        from lowcomm.runtime.checkpoint import CheckpointError, load_checkpoint
        try:
            load_checkpoint(args.resume)
        except CheckpointError as e:
            raise ConfigError(f"--resume: {e}") from None
    liars = (", Byzantine " + ", ".join(f"peer-{i} ({kind.value})" for i, kind in sorted(byzantine.items()))
             if byzantine else "")
    print(f"simulating {args.peers} peers{stages}, algo {config.run.algo}, {config.run.steps} steps each, "
          f"links {', '.join(links)}{mode}{churn}{liars}; records in {run_dir}", file=sys.stderr)
    page = _status_page(args, lambda page: page.for_records(run_dir, config.run.name, args.dashboard_host,
                                                            args.dashboard_port))
    try:
        report = Simulation(config, args.peers, run_dir, byzantine=byzantine, resume=args.resume,
                            peer_flags=peer_flags).run()
    except NetnsUnavailable as e:
        print(f"lowcomm: --netns: {e}", file=sys.stderr)
        return 2
    except (SimulationError, NetnsError) as e:
        print(f"lowcomm: simulation failed: {e}", file=sys.stderr)
        return 1
    finally:
        if page is not None:
            page.close()
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1))
    honest = " (honest peers)" if report.get("byzantine") else ""
    final = f"{report['final_loss']:.4f}" if report["final_loss"] is not None else "n/a (no peer evaluated)"
    print(f"final held-out loss{honest} {final}, {report['tokens']} tokens, "
          f"{report['bytes_sent'] / 1e6:.2f} MB sent, wall {report['wall_s']:.1f}s, "
          f"compute utilization {report['compute_utilization'] or 0:.2f}"
          + (f", {report['wire_bytes'] / 1e6:.2f} MB on the wire ({report['control_bytes'] / 1e6:.2f} MB DHT)"
             if report.get("netns") else "") + f"; report in {args.report}")
    try:
        from lowcomm.runtime.plots import write_report_figures
        print(f"figures and summary: {', '.join(map(str, write_report_figures(report, args.report)))}")
    except Exception as e:  # the report is written: a plotting problem must not fail the run
        logging.getLogger(__name__).warning("could not draw the report's figures: %s", e)
    return 1 if report.get("failed_peers") else 0


def export(args) -> int:
    from lowcomm.runtime.checkpoint import CheckpointError
    from lowcomm.runtime.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, load_config(args.config) if args.config else None)
    except CheckpointError as e:
        print(f"lowcomm: export: {e}", file=sys.stderr)
        return 2
    print(f"model written to {out}/model.safetensors with its config in {out}/config.json")
    return 0


def status(args) -> int:
    from lowcomm.runtime.preflight import check_multiaddrs
    from lowcomm.runtime.watch import print_status

    check_multiaddrs(args.coordinator)
    return print_status(args.coordinator, args.run)


if __name__ == "__main__":
    sys.exit(main())
