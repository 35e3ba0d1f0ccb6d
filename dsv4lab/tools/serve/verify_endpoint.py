"""``dsv4lab verify endpoint`` — check any OpenAI-compatible server against dsv4lab's fixed-id oracles.

For every oracle of a golden file (``{"oracles": [{"prompt_ids", "expected_ids", "hash", ...}]}``):

1. **Greedy run**: ``POST /v1/completions`` with the prompt as token ids, ``temperature=0``,
   ``max_tokens=len(expected_ids)``, ``ignore_eos`` (so the length is the oracle's), and — when the server
   offers them — logprobs (top 5) and the generated ids (vLLM's ``return_token_ids`` /
   ``return_tokens_as_token_ids``). Pass means the same ids; otherwise the first diverging position is
   reported with both tokens and, with logprobs, the server's logprob gap between its choice and the
   expected token at that position.
2. **Teacher-forced** (when the server supports ``echo`` with ``logprobs``, as vLLM does): the prompt
   followed by the expected ids is scored in one request; at every expected position the gap
   ``logprob(server's top token) − logprob(expected token)`` is ≥ 0 and 0 where the server agrees. Its maximum
   and the first position where the server's argmax differs tell a near-tie (tiny gap: numerics) from a
   broken model (large gap from the first tokens).

The trajectory hash is the project's: the first 16 hex digits of sha256 over the ids as little-endian int32.
A JSON and a markdown report are written (``--out``); the exit status is 0 only when every oracle passes.
This is how an SGLang or vLLM deployment of DeepSeek-V4-Flash is checked without touching its code.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from dsv4lab.engine.sampling import trajectory_hash
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import float_range
from dsv4lab.core.paths import read_json
from dsv4lab.core.provenance import identity, write_json

HELP = "check any OpenAI-compatible server against a golden file's fixed-id oracles (greedy + teacher-forced)"

TOP_LOGPROBS = 5


def add_arguments(p):
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--golden", required=True, help="golden file (e.g. data/golden/tiny.json)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-teacher-forced", action="store_true", help="skip the teacher-forced scoring request")
    p.add_argument("--timeout", type=float_range(0, lo_open=True), default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="report path stem (default runs/verify_endpoint/<time>)")


def load_golden(path: str | Path) -> list[dict]:
    """The oracles of a golden file, checked: each has integer ``prompt_ids`` and ``expected_ids``."""
    path = Path(path)
    doc = read_json(path, UserError)
    oracles = doc.get("oracles") if isinstance(doc, dict) else None
    if not isinstance(oracles, list) or not oracles:
        raise UserError(f"{path}: expected a non-empty list under the key 'oracles'")
    for k, o in enumerate(oracles):
        for key in ("prompt_ids", "expected_ids"):
            ids = o.get(key) if isinstance(o, dict) else None
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                raise UserError(f"{path}: oracles[{k}].{key}: expected a non-empty list of token ids")
        o.setdefault("name", f"oracle-{k}")
    return oracles


def _ids_from_tokens(tokens: list[str]) -> list[int] | None:
    ids = []
    for t in tokens:
        if not isinstance(t, str) or not t.startswith("token_id:"):
            return None
        ids.append(int(t.split(":", 1)[1]))
    return ids


class EndpointClient:
    """The few requests the check needs, tolerant of servers that lack vLLM's extensions."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        import httpx
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def close(self) -> None:
        self.http.close()

    def model(self) -> str:
        r = self.http.get(self.url + "/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.url}/v1/models lists no model")
        return data[0]["id"]

    def complete(self, body: dict) -> tuple[int, dict]:
        r = self.http.post(self.url + "/v1/completions", json=body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": {"message": r.text[:500]}}

    def greedy(self, model: str, prompt_ids: list[int], n: int) -> dict:
        """Greedy ids (and per-position logprobs when offered) for ``n`` tokens after ``prompt_ids``."""
        body = {"model": model, "prompt": prompt_ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                "skip_special_tokens": False, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "logprobs": TOP_LOGPROBS}
        status, doc = self.complete(body)
        with_logprobs = status == 200
        if status != 200:  # the server may not offer logprobs: ask again without them
            body.pop("logprobs")
            status, doc = self.complete(body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {doc.get('error', {}).get('message', doc)}")
        choice = doc["choices"][0]
        ids = choice.get("token_ids")
        logprobs = choice.get("logprobs") if with_logprobs else None
        if ids is None and logprobs:
            ids = _ids_from_tokens(logprobs.get("tokens") or [])
        return {"ids": ids, "text": choice.get("text"), "logprobs": logprobs}

    def teacher_forced(self, model: str, prompt_ids: list[int], expected: list[int]) -> dict | None:
        """Server logprobs of ``expected`` given ``prompt_ids`` (echo + logprobs), or None if unsupported."""
        body = {"model": model, "prompt": prompt_ids + expected, "max_tokens": 1, "temperature": 0.0,
                "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
        status, doc = self.complete(body)
        if status != 200:
            return None
        lp = doc["choices"][0].get("logprobs") or {}
        token_lps, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
        n0 = len(prompt_ids)
        if len(token_lps) < n0 + len(expected) or len(tops) < n0 + len(expected):
            return None
        gaps, argmax = [], []
        for i in range(len(expected)):
            mine, top = token_lps[n0 + i], tops[n0 + i]
            if mine is None or not top:
                return None
            best_token, best = max(top.items(), key=lambda kv: kv[1])
            gaps.append(max(best, mine) - mine)
            ids = _ids_from_tokens([best_token])
            argmax.append(ids[0] if ids else None)
        first = next((i for i, (a, e) in enumerate(zip(argmax, expected)) if a is not None and a != e and
                      gaps[i] > 0), None)
        return {"max_gap": max(gaps), "mean_gap": sum(gaps) / len(gaps), "gaps": gaps,
                "first_argmax_divergence": first}


def check_oracle(client: EndpointClient, model: str, oracle: dict, teacher_forced: bool) -> dict:
    """Run one oracle against the server; a dict with ``passed`` and the evidence."""
    prompt, expected = oracle["prompt_ids"], oracle["expected_ids"]
    report = {"name": oracle["name"], "prompt_len": len(prompt), "expected_len": len(expected),
              "expected_hash": oracle.get("hash"), "golden_hash_consistent": None}
    if oracle.get("hash") is not None:
        report["golden_hash_consistent"] = oracle["hash"] == trajectory_hash(expected)
    try:
        got = client.greedy(model, prompt, len(expected))
    except Exception as err:
        return {**report, "passed": False, "error": str(err)}
    ids = got["ids"]
    if ids is None:
        return {**report, "passed": False,
                "error": "the server returned neither token ids nor id-form logprob tokens; cannot compare ids"}
    first = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), None)
    if first is None and len(ids) != len(expected):
        first = min(len(ids), len(expected))
    report.update(got_ids=ids, got_hash=trajectory_hash(ids), passed=first is None, first_divergence=first)
    if first is not None:
        report["expected_token"] = expected[first] if first < len(expected) else None
        report["got_token"] = ids[first] if first < len(ids) else None
        lp = got["logprobs"]
        if lp and first < len(lp.get("top_logprobs") or []):
            top = lp["top_logprobs"][first] or {}
            chosen = lp["token_logprobs"][first]
            exp_lp = top.get(f"token_id:{expected[first]}")
            report["gap_at_divergence"] = None if exp_lp is None else chosen - exp_lp
            report["gap_note"] = None if exp_lp is not None else \
                f"expected token not in the server's top {TOP_LOGPROBS}"
    if teacher_forced:
        tf = client.teacher_forced(model, prompt, expected)
        report["teacher_forced"] = tf if tf is not None else "unavailable (no echo+logprobs support)"
    return report


def format_report(url: str, golden: str, model: str, reports: list[dict]) -> str:
    lines = [f"# verify endpoint", "", f"- server: `{url}` (model `{model}`)", f"- golden: `{golden}`", "",
             "| oracle | result | tokens | first divergence | expected → got | gap there | teacher-forced max gap |",
             "|---|---|---|---|---|---|---|"]
    for r in reports:
        tf = r.get("teacher_forced")
        tf_text = f"{tf['max_gap']:.4g}" if isinstance(tf, dict) else (tf or "—")
        div = r.get("first_divergence")
        pair = f"{r.get('expected_token')} → {r.get('got_token')}" if div is not None else "—"
        gap = r.get("gap_at_divergence")
        lines.append(f"| {r['name']} | {'PASS' if r['passed'] else 'FAIL'} | {r['expected_len']} | "
                     f"{'—' if div is None else div} | {pair} | {'—' if gap is None else f'{gap:.4g}'} | {tf_text} |")
        if r.get("error"):
            lines.append(f"|  | error: {r['error']} | | | | | |")
    passed = sum(r["passed"] for r in reports)
    lines += ["", f"**{passed}/{len(reports)} oracles pass.**"]
    return "\n".join(lines)


def run(args) -> int:
    oracles = load_golden(args.golden)
    client = EndpointClient(args.url, args.api_key, args.timeout)
    try:
        try:
            model = args.model or client.model()
        except Exception as err:
            raise UserError(f"cannot list models at {args.url}/v1/models: {err}") from None
        reports = []
        for oracle in oracles:
            print(f"{oracle['name']}: {len(oracle['prompt_ids'])} prompt ids, {len(oracle['expected_ids'])} "
                  f"expected ...", file=sys.stderr)
            reports.append(check_oracle(client, model, oracle, not args.no_teacher_forced))
    finally:
        client.close()
    text = format_report(args.url, args.golden, model, reports)
    print(text)
    stem = args.out or str(Path("runs") / "verify_endpoint" / time.strftime("%Y%m%d-%H%M%S"))
    stem = stem[:-5] if stem.endswith(".json") else stem
    doc = {"check": "endpoint", "meta": {**identity(), "url": args.url, "model": model, "golden": str(args.golden)},
           "passed": all(r["passed"] for r in reports), "oracles": reports}
    json_path = write_json(stem + ".json", doc)
    Path(stem + ".md").write_text(text + "\n")
    print(f"wrote {json_path} and {stem}.md")
    return 0 if all(r["passed"] for r in reports) else 1
