"""The `fairtick` command: `serve`, `cluster`, `trace` and `check`.

`check` imports neither MLX nor Sanic (it delegates to statemachine.checker_cli); `trace` is a
plain HTTP client; only `serve` loads the runtime; only `cluster` imports Ray (cluster.cli).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from statemachine.argtypes import integer_at_least, seconds

DEFAULT_URL = "http://127.0.0.1:8000"
POLICY_ENV = "FAIRTICK_POLICY"
API_KEY_ENV = "FAIRTICK_API_KEY"
# runtime.blas.BLAS_ENV, spelled here: importing anything from runtime loads the BLAS it names.
BLAS_ENV = "FAIRTICK_BLAS"
log = logging.getLogger("fairtick.server")
# What `pip install -e .[cluster]` adds (ray[serve] brings aiohttp and starlette).
CLUSTER_MODULES = ("ray", "aiohttp", "starlette")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fairtick` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else (None, [])
    if command == "check":
        from statemachine.checker_cli import main as check_main

        return _printing(lambda: int(check_main(rest)))
    if command == "serve":
        return serve_main(rest)
    if command == "cluster":
        return _cluster_main(rest)
    if command == "trace":
        return _printing(lambda: trace_main(rest))
    parser = _top_parser()
    if command in ("-h", "--help"):
        parser.print_help()
        return 0
    parser.print_usage(sys.stderr)
    print(f"fairtick: error: choose a command: serve, cluster, trace or check "
          f"(got {command!r})",
          file=sys.stderr)
    return 2


def _printing(command: Callable[[], int]) -> int:
    """Run a command that prints to stdout; if its reader goes away (`fairtick trace | head`),
    stop quietly with SIGPIPE's exit status, as Unix tools do, instead of a traceback."""
    try:
        code = command()
        sys.stdout.flush()  # here, not at exit, where a broken pipe could not be caught
        return code
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairtick", description="LLM inference server on MLX "
                                     "with a declarative, model-checked tick scheduler.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="serve the OpenAI-compatible API (see `fairtick serve --help`)")
    sub.add_parser("cluster", help="serve N engines as Ray Serve replicas behind one "
                   "endpoint (needs `pip install -e .[cluster]`; see `fairtick cluster --help`)")
    sub.add_parser("trace", help="print a running server's scheduler trace")
    sub.add_parser("check", help="model-check the policies' claims (see `fairtick check --help`)")
    return parser


def serve_main(argv: Sequence[str]) -> int:
    """`fairtick serve`: the policy is read first, since its spec declares more flags."""
    parsed = parse_serve_args(argv, "fairtick serve")
    if isinstance(parsed, int):
        return parsed
    config, _, blas = parsed
    from server.listener import bind_listener

    # Bound before the model loads: an address it cannot listen on ends start-up at once.
    try:
        sock = bind_listener(config.host, config.port)
    except ValueError as exc:
        print(f"fairtick serve: {exc}", file=sys.stderr)
        return 2
    from server.app import create_app
    from server.logs import configure_logging

    configure_logging(config.log_level)
    log.info("BLAS: %s", blas.describe())
    from runtime.attention import fast_softmax_reason

    reason = fast_softmax_reason()
    log.info("attention softmax: %s", "fast (compiled exp, with compiled RMSNorm and rope "
             "rotation; $FAIRTICK_SOFTMAX=exact for MLX's)" if reason is None
             else f"MLX's ({reason}; RMSNorm and rope MLX's too)")
    from runtime import native

    kernel_reason = native.reason()
    log.info("native kernels: %s", "fairtick's, for prompt slices' and decode rows' attention, "
             f"the MLP's activation, the rope's rotation and RMSNorm (${native.KERNEL_ENV}=off "
             "for MLX's ops)"
             if kernel_reason is None else f"MLX's ops ({kernel_reason})")
    from runtime.attention import ATTENTION_STREAMS, STREAMS_ENV

    log.info("attention streams: %s", f"2 (a tick's segments spread over two CPU streams; "
             f"${STREAMS_ENV}=1 for one)" if ATTENTION_STREAMS > 1 else "1")
    app = create_app(config)
    # One app in this process: Sanic's TouchUp may rewrite its classes (create_app turns it off
    # for processes that make several). Without it every response carried an empty `alt-svc:`.
    app.config.TOUCHUP = True
    app.run(sock=sock, backlog=config.listen_backlog, single_process=True, motd=False,
            access_log=config.access_log)
    return 0


def _cluster_main(argv: Sequence[str]) -> int:
    # Ray is an optional extra: without it, say how to install it (any other error is a bug).
    try:
        from cluster.cli import cluster_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in CLUSTER_MODULES:
            raise
        print(f"fairtick cluster: needs Ray Serve ({exc}); install it with "
              "`pip install -e '.[cluster]'`", file=sys.stderr)
        return 2
    return cluster_main(argv)


def parse_serve_args(argv: Sequence[str], prog: str,
                     add_flags: Any = None) -> tuple[Any, argparse.Namespace, Any] | int:
    """The ServerConfig, the parsed arguments and the BLAS of `fairtick serve`'s flags (and
    those `add_flags(parser)` adds), or the exit status after printing what was wrong."""
    from server.policy_flags import add_policy_flags, resolve_policy_params
    from statemachine.lifecycle import load_lifecycle
    from statemachine.scheduler import require_kv_roles
    from statemachine.spec import SpecError, load_policy
    from statemachine.tick import make_policy

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--policy", default=os.environ.get(POLICY_ENV, "default"))
    pre.add_argument("--blas", default=None)
    pre.add_argument("--lifecycle", default=None)
    known, _ = pre.parse_known_args(argv)
    try:
        blas = _load_blas(known.blas)
        from runtime.cachedir import usable_cache_dir

        usable_cache_dir()  # the built-in model and the BLAS shim are kept there
        from runtime import kernels

        # $FAIRTICK_SOFTMAX checked, and the compiled kernels (softmax, RMSNorm, rope rotation)
        # built once here, before `fairtick cluster` starts replicas that would otherwise all
        # build them at once.
        kernels.warm_up()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        spec = load_policy(known.policy)
    except SpecError as exc:
        print(f"{prog}: invalid policy spec: {exc}", file=sys.stderr)
        return 2
    try:
        life = load_lifecycle(known.lifecycle)
    except SpecError as exc:
        print(f"{prog}: invalid lifecycle spec: {exc}", file=sys.stderr)
        return 2
    parser = _serve_parser(prog)
    add_policy_flags(parser, spec)
    if add_flags is not None:
        add_flags(parser)
    args = parser.parse_args(argv)
    try:
        params = resolve_policy_params(spec, vars(args), os.environ)
        config = make_server_config(args, params)
    except ValueError as exc:
        print(f"{prog}: {_named_by_flag(parser, str(exc))}", file=sys.stderr)
        return 2
    try:  # the server always has a KV budget: its policy's kv_full needs its states
        require_kv_roles(life, make_policy(spec, params))
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return config, args, blas


def _named_by_flag(parser: argparse.ArgumentParser, message: str) -> str:
    # The settings' own checks name their fields ("max_waiting must be ...", "allowed_origins:
    # ..."): the user typed a flag, so the message names that, and any other field it names
    # (each flag's dest is its setting's field name).
    flags = {action.dest: action.option_strings[0] for action in parser._actions
             if action.option_strings}
    words = message.split(" ")
    for i, word in enumerate(words):
        field = word.rstrip(":")
        flag = flags.get(field)
        if flag is not None and (i == 0 or "_" in field):
            words[i] = flag + word[len(field):]
    return " ".join(words)


def _load_blas(setting: str | None) -> Any:
    """The BLAS MLX will run on (runtime.blas.BlasInfo): `--blas` must reach the environment
    before `runtime` is first imported. ValueError for a bad value, or for a process that has
    already loaded another."""
    if setting is not None:
        os.environ[BLAS_ENV] = setting
    from runtime.blas import load_blas, parse_setting

    blas = load_blas()
    if setting is not None and blas.setting != parse_setting(setting):
        raise ValueError(f"--blas {setting}: this process already runs on {blas.setting!r}")
    return blas


def _serve_parser(prog: str = "fairtick serve") -> argparse.ArgumentParser:
    from runtime.engine import EngineConfig
    from runtime.engine_config import LANE_PRIORITIES, LANE_PRIORITY_ENV
    from server.config import ServerConfig
    from server.validation import DEFAULT_MAX_BODY_BYTES

    d = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    server = ServerConfig()
    p = argparse.ArgumentParser(prog=prog,
                                description="Serve the OpenAI-compatible API on HTTP.")
    p.add_argument("--model", default=d["model"], metavar="PATH",
                   help="local mlx-lm model directory (default: the built-in offline model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--max-running", "--parallel", type=int, default=d["max_running"],
                   metavar="N", dest="max_running",
                   help=f"sequences that may hold KV at once; the KV budget is the real limit "
                   f"(default {d['max_running']}; --parallel is the old name)")
    p.add_argument("--prefill-chunk-size", type=int, default=d["prefill_chunk_size"],
                   metavar="N", help=f"prompt tokens per prefill chunk "
                   f"(default {d['prefill_chunk_size']})")
    p.add_argument("--policy", default=os.environ.get(POLICY_ENV, d["policy"]),
                   metavar="NAME|PATH", help=f"tick policy: a shipped name or a YAML file (env "
                   f"{POLICY_ENV}; default {d['policy']!r})")
    p.add_argument("--max-waiting", type=int, default=d["max_waiting"], metavar="N",
                   help=f"requests not yet admitted beyond which new ones get 429; at least 1, "
                   f"as every request waits here before it is admitted (default "
                   f"{d['max_waiting']})")
    p.add_argument("--max-kv-tokens", type=int, default=d["max_kv_tokens"], metavar="N",
                   help="the KV token budget: past it arrivals queue and the policy's kv_full "
                   "preempts (default: half the memory available at start-up, divided by the "
                   "model's KV bytes a token; logged at start-up)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction,
                   default=d["prefix_cache"],
                   help="keep finished requests' KV so that a prompt starting with the same "
                   "tokens prefills only the rest; evicted before it would cost anyone KV room "
                   "(default: on)")
    p.add_argument("--prefix-cache-tokens", type=int, default=d["prefix_cache_tokens"],
                   metavar="N", help="the most tokens of KV the prefix cache holds (default: "
                   "whatever the KV budget leaves free)")
    p.add_argument("--lifecycle", default=d["lifecycle"], metavar="FILE",
                   help="lifecycle spec (default: specs/lifecycle.yaml)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--listen-backlog", type=int, default=server.listen_backlog, metavar="N",
                   help=f"connections the kernel queues before they are accepted; capped at "
                   f"net.core.somaxconn (default {server.listen_backlog})")
    p.add_argument("--stop-grace-s", type=float, default=server.stop_grace_s, metavar="S",
                   help=f"on SIGTERM or Ctrl-C, seconds in-flight requests may run before they "
                   f"are aborted with 503 (default {server.stop_grace_s:g})")
    p.add_argument("--trace-capacity", type=int, default=d["trace_capacity"], metavar="N",
                   help=f"transitions kept for /debug/trace (default {d['trace_capacity']})")
    p.add_argument("--blas", default=os.environ.get(BLAS_ENV, "auto"),
                   metavar="auto|reference|PATH",
                   help=f"BLAS under MLX: 'auto' (an optimized OpenBLAS when it can be had, "
                   f"else MLX's bundled reference BLAS), 'reference', or the path of a shared "
                   f"library exporting the CBLAS names (env {BLAS_ENV}; default 'auto')")
    p.add_argument("--lane-priority", default=os.environ.get(LANE_PRIORITY_ENV) or
                   d["lane_priority"], metavar="|".join(LANE_PRIORITIES),
                   help="a lane policy's prefill lane: 'idle' runs its threads in Linux's "
                   "SCHED_IDLE class, on what the decode streams and the server leave of the "
                   "cores, so a stream's step takes a core ahead of the prompt's work; 'normal' "
                   f"shares the cores as every thread does (env {LANE_PRIORITY_ENV}; default "
                   f"{d['lane_priority']!r})")
    p.add_argument("--check-invariants", action="store_true",
                   help="check the scheduler invariants after every tick (slower)")
    _add_log_flags(p)
    _add_api_flags(p)
    return p


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    from server.logs import LOG_LEVEL_ENV, LOG_LEVELS

    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", default=os.environ.get(LOG_LEVEL_ENV) or "info",
                      metavar="LEVEL", help=f"{', '.join(LOG_LEVELS)}: start-up progress and one "
                      f"line per request at info (env {LOG_LEVEL_ENV}; default info)")
    logs.add_argument("--access-log", action="store_true",
                      help="log one line per HTTP response (client, request line, status, "
                      "bytes, time to the response's headers) at info (default: off)")


def _add_api_flags(p: argparse.ArgumentParser) -> None:
    from server.validation import DEFAULT_CHAT_MAX_TOKENS

    api = p.add_argument_group("API")
    api.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     dest="served_model_names",
                     help="the model ids requests may name; the first is the id reported "
                     "(default: the model directory's name)")
    api.add_argument("--default-chat-max-tokens", type=int, default=DEFAULT_CHAT_MAX_TOKENS,
                     metavar="N", help=f"max_tokens of a chat request that sends none, cut to "
                     f"the room its prompt leaves (default {DEFAULT_CHAT_MAX_TOKENS}; "
                     f"completions keep OpenAI's 16)")
    api.add_argument("--api-key", default=None, metavar="KEY",
                     help=f"requests must send `Authorization: Bearer KEY`, else 401 (env "
                     f"{API_KEY_ENV}, which keeps the key out of the process list; default: "
                     "no key)")
    api.add_argument("--api-key-protect-ops", action="store_true",
                     help="ask the key of /health, /metrics, /version and /debug/* too "
                     "(default: they stay open)")
    api.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                     help="CORS: '*' or a comma-separated list of origins (e.g. "
                     "'https://app.example.com,http://localhost:3000') whose pages may call "
                     "the API (default: off, no CORS headers)")


def make_server_config(args: argparse.Namespace, params: dict[str, int | float]) -> Any:
    """The ServerConfig for parsed `serve` arguments; ValueError names a bad value."""
    from runtime.engine import EngineConfig
    from server.config import ServerConfig

    if args.model is not None and not (Path(args.model) / "config.json").exists():
        raise ValueError(f"--model: {args.model} is not an mlx-lm model directory "
                         "(no config.json)")
    engine = EngineConfig(
        model=args.model, max_running=args.max_running,
        prefill_chunk_size=args.prefill_chunk_size, policy=args.policy, policy_params=params,
        max_waiting=args.max_waiting, max_kv_tokens=args.max_kv_tokens,
        prefix_cache=args.prefix_cache, prefix_cache_tokens=args.prefix_cache_tokens,
        lifecycle=args.lifecycle, trace_capacity=args.trace_capacity,
        check_invariants=args.check_invariants, lane_priority=args.lane_priority,
    )
    origins = args.allowed_origins
    return ServerConfig(
        engine=engine, host=args.host, port=args.port, max_body_bytes=args.max_body_bytes,
        listen_backlog=args.listen_backlog, stop_grace_s=args.stop_grace_s,
        served_model_names=tuple(args.served_model_names or ()),
        default_chat_max_tokens=args.default_chat_max_tokens,
        # An empty variable counts as unset, as shells make it easy to export one.
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        api_key_protect_ops=args.api_key_protect_ops,
        allowed_origins=tuple(o.strip() for o in origins.split(",")) if origins else (),
        log_level=args.log_level, access_log=args.access_log,
    )


def trace_main(argv: Sequence[str]) -> int:
    """`fairtick trace`: fetch /debug/trace and print it as a table or JSON lines."""
    p = argparse.ArgumentParser(prog="fairtick trace",
                                description="Print a running server's scheduler transitions.")
    p.add_argument("--url", type=_server_url, default=DEFAULT_URL,
                   help=f"server base URL (default {DEFAULT_URL})")
    p.add_argument("--since", type=integer_at_least(0), default=0, metavar="T",
                   help="first tick to show")
    p.add_argument("--since-s", type=seconds(allow_zero=True), default=None, metavar="S",
                   help="events from S seconds after the server started")
    p.add_argument("--state", default=None, help="events from or to this lifecycle state")
    p.add_argument("--limit", type=integer_at_least(1), default=None, metavar="N",
                   help="the latest N events")
    p.add_argument("--request", default=None, metavar="ID",
                   help="one request's story: each stretch it spent queued, prefilling and "
                   "decoding, in seconds, with the rules that kept it waiting")
    p.add_argument("--perfetto", metavar="FILE", default=None,
                   help="write the trace in the Trace Event Format (JSON) for ui.perfetto.dev "
                   "or chrome://tracing")
    p.add_argument("--json", action="store_true", help="raw JSON lines instead of a table")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="draw the trace as a PNG picture (one lane per sequence, coloured by "
                   "state) instead of printing it")
    p.add_argument("--ticks", action="store_true",
                   help="--png: ticks on the x axis instead of seconds (traces without times, "
                   "such as `fairtick check` output, are drawn by tick anyway)")
    p.add_argument("--file", metavar="JSONL", default=None,
                   help="read trace JSON lines (or `fairtick check` output) from a file "
                   "instead of --url")
    p.add_argument("--lifecycle", metavar="PATH", default=None,
                   help="--png: the lifecycle spec the trace ran under, whose roles colour its "
                   "states (default specs/lifecycle.yaml)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
                   help=f"sent as a bearer token, for a server started with "
                   f"--api-key-protect-ops (env {API_KEY_ENV})")
    args = p.parse_args(argv)
    # Flags that shape one output only: with another they were silently ignored.
    if args.ticks and args.png is None:
        p.error("--ticks applies to --png only")
    if args.lifecycle is not None and args.png is None:
        p.error("--lifecycle applies to --png only")
    outputs = [flag for flag, on in (("--json", args.json), ("--png", args.png is not None),
                                     ("--perfetto", args.perfetto is not None),
                                     ("--request", args.request is not None)) if on]
    if len(outputs) > 1:
        p.error(f"{' and '.join(outputs)} each choose the output: give one")
    if args.file is not None:
        from server.trace_png import read_trace_file

        file_text = read_trace_file(args.file, args.since, args.limit)
        if file_text is None:
            return 1
        text = file_text
    else:
        query = {"since": args.since, "limit": args.limit, "since_s": args.since_s,
                 "state": args.state, "request_id": args.request,
                 "format": "perfetto" if args.perfetto else None}
        query = {k: v for k, v in query.items() if v is not None}
        url = f"{args.url.rstrip('/')}/debug/trace?{urllib.parse.urlencode(query)}"
        auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=auth),
                                        timeout=30) as response:
                text = response.read().decode("utf-8")
        except urllib.error.HTTPError as exc:
            print(f"fairtick trace: {url}: HTTP {exc.code}: "
                  f"{exc.read().decode(errors='replace')}", file=sys.stderr)
            return 2 if exc.code == 400 else 1  # 400: the server names the bad argument
        except (urllib.error.URLError, OSError) as exc:
            print(f"fairtick trace: cannot reach {url}: {exc}", file=sys.stderr)
            return 1
    if args.perfetto is not None:
        return _write_perfetto(text, args.perfetto, from_server=args.file is None)
    if args.request is not None:
        from statemachine.trace_story import format_request

        print(format_request((json.loads(line) for line in text.splitlines() if line.strip()),
                             args.request))
        return 0
    if args.png is not None:
        from server.trace_png import trace_end_tick, write_trace_png
        from statemachine.lifecycle import load_lifecycle
        from statemachine.spec import SpecError

        try:
            life = load_lifecycle(args.lifecycle)
        except SpecError as exc:
            print(f"fairtick trace: invalid lifecycle spec: {exc}", file=sys.stderr)
            return 2
        end_tick = trace_end_tick(args.file, args.url)
        return write_trace_png(text, args.png, args.file or args.url, end_tick, args.ticks,
                               life)
    if args.json:
        sys.stdout.write(text)
        return 0
    from statemachine.trace import format_table

    print(format_table(json.loads(line) for line in text.splitlines() if line.strip()))
    return 0


def _server_url(text: str) -> str:
    # urllib took 'notaurl' and raised deep in the request (a traceback).
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text


def _write_perfetto(text: str, path: str, from_server: bool) -> int:
    # The server sends the Trace Event Format itself (with its ticks); a file of JSON lines
    # is converted here (events only).
    if not from_server:
        from server.trace_perfetto import to_perfetto

        text = json.dumps(to_perfetto([json.loads(line) for line in text.splitlines()
                                       if line.strip()]))
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"fairtick trace: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0
