"""What scripts/bench_grammar.py measures on: schemas, documents valid and invalid, tokenizers."""

from __future__ import annotations

import copy
import json
import random
import sysconfig
from pathlib import Path
from typing import Any

# A realistic client schema: nested objects, arrays of objects, enums, integer bounds, required,
# additionalProperties false at every level, anyOf (a tagged union and a nullable string).
ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 16},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "vip": {"type": "boolean"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 24},
                        "city": {"type": "string", "maxLength": 16},
                        "country": {"enum": ["DE", "FR", "US", "JP"]},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "payment": {
            "anyOf": [
                {"type": "object",
                 "properties": {"method": {"const": "card"},
                                "last4": {"type": "string", "maxLength": 4}},
                 "required": ["method", "last4"], "additionalProperties": False},
                {"type": "object",
                 "properties": {"method": {"const": "invoice"},
                                "due_days": {"type": "integer", "minimum": 0, "maximum": 90}},
                 "required": ["method", "due_days"], "additionalProperties": False},
            ]
        },
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["id", "status", "customer", "items", "payment"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict[str, Any]] = {"order": ORDER, "json_object": {"type": "object"}}

_ORDER_EXAMPLE: dict[str, Any] = {
    "id": "A1", "status": "paid", "priority": 2, "tags": ["gift"],
    "customer": {"name": "Ada", "vip": True,
                 "address": {"street": "Main 1", "city": "Bonn", "country": "DE"}},
    "items": [{"sku": "X1", "quantity": 2, "price": 9.5}],
    "payment": {"method": "card", "last4": "4242"}, "note": None,
}


def _broken(path: list[Any], value: Any = None, *, delete: bool = False) -> dict[str, Any]:
    doc = copy.deepcopy(_ORDER_EXAMPLE)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


def invalid_documents(schema_name: str) -> dict[str, Any]:
    """Documents that each break one rule of the schema, by the rule they break; every one is
    checked invalid with `jsonschema` here, so the list cannot hold a valid one."""
    import jsonschema

    if schema_name != "order":
        cases: dict[str, Any] = {"array at the top": [], "string at the top": "x"}
    else:
        cases = {
            "missing required (top)": _broken(["status"], delete=True),
            "missing required (nested)": _broken(["customer", "address", "city"], delete=True),
            "extra property (top)": _broken(["extra"], 1),
            "extra property (nested)": _broken(["customer", "address", "zip"], "1"),
            "extra property (array item)": _broken(["items", 0, "color"], "red"),
            "enum value": _broken(["status"], "lost"),
            "nested enum value": _broken(["customer", "address", "country"], "XX"),
            "type in array": _broken(["tags", 0], 1),
            "integer above maximum": _broken(["priority"], 9),
            "number for integer": _broken(["items", 0, "quantity"], 1.5),
            "too many items": _broken(["tags"], ["a", "b", "c", "d", "e"]),
            "too few items": _broken(["items"], []),
            "string too long": _broken(["id"], "x" * 17),
            "no anyOf branch": _broken(["payment"], {"method": "cash"}),
            "anyOf branches mixed": _broken(["payment"], {"method": "card", "due_days": 3}),
            "anyOf wrong type": _broken(["note"], 5),
        }
    for name, doc in cases.items():
        if jsonschema.Draft202012Validator(SCHEMAS[schema_name]).is_valid(doc):
            raise AssertionError(f"invalid case {name!r} is valid")
    return cases


def valid_documents(schema_name: str, count: int = 100, seed: int = 0) -> list[Any]:
    """`count` seeded random documents of the schema, each checked valid with `jsonschema`:
    strings of printable ASCII, accents, CJK, quotes, backslashes and newlines; every optional
    property present or not; both anyOf branches; arrays of every allowed length."""
    import jsonschema

    rng = random.Random(seed)
    make = _random_order if schema_name == "order" else _random_object
    docs = [_in_schema_order(make(rng), SCHEMAS[schema_name]) for _ in range(count)]
    validator = jsonschema.Draft202012Validator(SCHEMAS[schema_name])
    for doc in docs:
        validator.validate(doc)
    return docs


def _in_schema_order(doc: Any, schema: dict[str, Any]) -> Any:
    # The engines write properties in the order the schema lists them (JSON Schema leaves the
    # order free, so a document in another order is valid but not what they generate).
    if isinstance(doc, list):
        return [_in_schema_order(d, schema.get("items", {})) for d in doc]
    if not isinstance(doc, dict) or "properties" not in schema and "anyOf" not in schema:
        return doc
    props: dict[str, Any] = dict(schema.get("properties", {}))
    for branch in schema.get("anyOf", []):
        props.update(branch.get("properties", {}))
    return {k: _in_schema_order(doc[k], props[k]) for k in props if k in doc}


_CHARS = [chr(c) for c in range(32, 127)] + ["é", "ß", "日", "本", "\n", "\"", "\\", "\t"]


def _text(rng: random.Random, max_len: int) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, max_len)))


def _random_order(rng: random.Random) -> dict[str, Any]:
    props = ORDER["properties"]
    doc: dict[str, Any] = {
        "id": _text(rng, 16), "status": rng.choice(props["status"]["enum"]),
        "customer": {"name": _text(rng, 24), "address": {
            "street": _text(rng, 24), "city": _text(rng, 16),
            "country": rng.choice(["DE", "FR", "US", "JP"])}},
        "items": [{"sku": _text(rng, 8), "quantity": rng.randint(1, 99),
                   "price": rng.choice([0, 3, -2.5, 1e-3, 12345.678, 1.5e10])}
                  for _ in range(rng.randint(1, 3))],
        "payment": rng.choice([{"method": "card", "last4": _text(rng, 4)},
                               {"method": "invoice", "due_days": rng.randint(0, 90)}]),
    }
    optional = {"priority": rng.randint(1, 5), "tags": [_text(rng, 12)] * rng.randint(0, 4),
                "note": rng.choice([None, _text(rng, 20)])}
    doc.update({k: v for k, v in optional.items() if rng.random() < 0.5})
    if rng.random() < 0.5:
        doc["customer"]["vip"] = rng.random() < 0.5
    return doc


def _random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    def value() -> Any:
        kinds = ["str", "int", "float", "bool", "null"] + (["obj", "arr"] if depth < 2 else [])
        kind = rng.choice(kinds)
        if kind == "obj":
            return _random_object(rng, depth + 1)
        if kind == "arr":
            return [rng.randint(-9, 9) for _ in range(rng.randint(0, 3))]
        return {"str": lambda: _text(rng, 10), "int": lambda: rng.randint(-1000, 1000),
                "float": lambda: rng.uniform(-1e3, 1e3), "bool": lambda: rng.random() < 0.5,
                "null": lambda: None}[kind]()

    return {_text(rng, 6): value() for _ in range(rng.randint(0, 4))}


def tokenizer_json(vocab: str) -> tuple[str, int]:
    """A tokenizer's JSON and its EOS id: the built-in model's ("builtin") or a byte-level BPE
    of that many tokens trained on the standard library's source (cached)."""
    if vocab == "builtin":
        from runtime.model import EOS_ID, make_builtin_model

        return (make_builtin_model() / "tokenizer.json").read_text(), EOS_ID
    from runtime.cachedir import default_cache_dir

    size = int(vocab)
    path = default_cache_dir() / "bench-tokenizers" / f"bpe-{size}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(_train(size))
        tmp.rename(path)
    text = path.read_text()
    return text, json.loads(text)["added_tokens"][1]["id"]


def _train(size: int) -> str:
    # The first ~100 MB of the standard library's .py files (code, docstrings, comments).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            texts.append(f.read_text("utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        total += len(texts[-1])
        if total > 100e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()
