"""Command-line options shared by the admission script and the matrix driver."""

from __future__ import annotations

import argparse

from benchlib.admission import AdmissionConfig


def add_admission_options(p: argparse.ArgumentParser) -> None:
    """The run layout: the same for every arm that is to be compared."""
    d = AdmissionConfig(url="")
    p.add_argument("--streams", type=int, default=d.streams,
                   help=f"decode streams running when the prompt arrives ({d.streams})")
    p.add_argument("--stream-tokens", type=int, default=d.stream_tokens, metavar="N",
                   help=f"max_tokens of each stream; they are closed a few tokens after the "
                   f"prompt's first token, so this is a cap ({d.stream_tokens})")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, metavar="N",
                   help=f"length of the admitted prompt ({d.prompt_tokens})")
    p.add_argument("--settle-s", type=float, default=d.settle_s, metavar="S",
                   help=f"quiet window: decode alone for this long before admission "
                   f"({d.settle_s})")
    p.add_argument("--post-s", type=float, default=d.post_s, metavar="S",
                   help=f"the streams decode this long after the prompt's first token; their "
                   f"p95 there, or in the quiet window if larger, is their own p95 "
                   f"({d.post_s})")
    p.add_argument("--alone", choices=("first", "last", "skip"), default=d.alone,
                   help="measure the prompt's TTFT alone on the idle server before or after "
                   "the streams, or not at all (first)")
    p.add_argument("--ttft-alone-s", type=float, default=None, metavar="S",
                   help="use this TTFT alone instead of measuring it")
    p.add_argument("--tail-tokens", type=int, default=d.tail_tokens, metavar="N",
                   help=f"stream tokens after the prompt's first token before each stream is "
                   f"closed ({d.tail_tokens})")
    p.add_argument("--start-timeout-s", type=float, default=d.start_timeout_s, metavar="S",
                   help=f"every stream must have its first token within this "
                   f"({d.start_timeout_s:.0f})")
    p.add_argument("--min-quiet-gaps", type=int, default=d.min_quiet_gaps, metavar="N",
                   help=f"inter-token gaps each stream needs in the quiet window "
                   f"({d.min_quiet_gaps})")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, metavar="S",
                   help=f"bound on one whole run ({d.timeout_s:.0f})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompt text")
    p.add_argument("--shared-prefix-tokens", type=int, default=d.shared_prefix_tokens,
                   metavar="N", help="a system prompt of N tokens that the streams' prompts and "
                   "the long prompt all begin with, sent first by the warm-up; requests may "
                   "then use the prefix cache (0: none, and every request opts out of it)")


def config_from_args(args: argparse.Namespace, url: str) -> AdmissionConfig:
    """The AdmissionConfig of parsed options; ValueError names a bad one."""
    return AdmissionConfig(
        url=url, streams=args.streams, stream_tokens=args.stream_tokens,
        prompt_tokens=args.prompt_tokens, settle_s=args.settle_s, post_s=args.post_s,
        alone=args.alone, ttft_alone_s=args.ttft_alone_s, tail_tokens=args.tail_tokens,
        start_timeout_s=args.start_timeout_s,
        min_quiet_gaps=args.min_quiet_gaps, timeout_s=args.timeout_s, seed=args.seed,
        shared_prefix_tokens=args.shared_prefix_tokens)
