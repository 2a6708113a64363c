"""The schema: generated code is fresh, field numbers never change, every message round-trips."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from services.common import pb

ROOT = Path(__file__).resolve().parents[2]
PB_DIR = Path(pb.__path__[0])
sys.path.insert(0, str(ROOT / "proto"))
import generate  # noqa: E402  (proto/generate.py)

MODULES = [importlib.import_module(f"services.common.pb.{p.stem}") for p in sorted(PB_DIR.glob("*_pb2.py"))]


def all_message_classes() -> list[type[Message]]:
    classes = []
    for module in MODULES:
        for name in module.DESCRIPTOR.message_types_by_name:
            classes.append(getattr(module, name))
    return classes


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """`make proto` output must match what is committed, byte for byte."""
    out = tmp_path / "pb"
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_bytes() for p in out.iterdir()}
    committed = {p.name: p.read_bytes() for p in PB_DIR.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run `make proto`"


def test_no_field_number_or_type_ever_changes() -> None:
    """proto/fields.lock lists every field shipped; each must still exist as it was."""
    locked = {line for line in generate.LOCK_FILE.read_text().splitlines() if not line.startswith("#")}
    current = generate.field_lines()
    broken = sorted(locked - current)
    assert not broken, f"fields renumbered, retyped or removed (field numbers are forever): {broken}"
    unlocked = sorted(current - locked)
    assert not unlocked, f"new fields missing from proto/fields.lock: run `make proto`: {unlocked}"


def _value_for(field: FieldDescriptor, depth: int) -> object:
    """A non-default value of the field's type, different per field number."""
    seed = field.number
    scalars: dict[int, object] = {
        FieldDescriptor.TYPE_STRING: f"s{seed}-é",
        FieldDescriptor.TYPE_BYTES: bytes([seed % 256, 0, 255]),
        FieldDescriptor.TYPE_BOOL: True,
        FieldDescriptor.TYPE_FLOAT: seed + 0.5,
        FieldDescriptor.TYPE_DOUBLE: seed + 0.25,
        FieldDescriptor.TYPE_INT32: -seed,
        FieldDescriptor.TYPE_INT64: 2**40 + seed,
    }
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    return scalars[field.type]


def fill(message: Message, depth: int = 0) -> Message:
    """Set every field of ``message`` (recursing into sub-messages) to a non-default value."""
    descriptor: Descriptor = message.DESCRIPTOR
    for field in descriptor.fields:
        target = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            key = _value_for(key_field, depth)
            if value_field.message_type is not None:
                fill(target[key], depth + 1)
            else:
                target[key] = _value_for(value_field, depth)
        elif field.message_type is not None:
            if field.message_type.full_name == "google.protobuf.Timestamp":
                sub = target.add() if field.is_repeated else target
                sub.seconds, sub.nanos = 1_700_000_000, 123
            elif field.is_repeated:
                fill(target.add(), depth + 1)
                fill(target.add(), depth + 1)
            else:
                fill(target, depth + 1)
        elif field.is_repeated:
            target.extend([_value_for(field, depth), _value_for(field, depth)])
        else:
            setattr(message, field.name, _value_for(field, depth))
    return message


@pytest.mark.parametrize("cls", all_message_classes(), ids=lambda c: c.DESCRIPTOR.full_name)
def test_every_message_round_trips(cls: type[Message]) -> None:
    original = fill(cls())
    unset = [f.name for f in cls.DESCRIPTOR.fields if not f.is_repeated and f.has_presence
             and not original.HasField(f.name)
             and not (f.containing_oneof and original.WhichOneof(f.containing_oneof.name))]  # fmt: skip
    # a oneof holds one member: the filler's last (each member's type is round-tripped on its own)
    assert not unset, f"filler left fields unset: {unset}"
    wire = original.SerializeToString()
    parsed = cls.FromString(wire)
    assert parsed == original
    assert parsed.SerializeToString(deterministic=True) == original.SerializeToString(deterministic=True)


def test_every_proto_file_is_generated() -> None:
    protos = {p.stem for p in generate.proto_files()}
    assert protos == {"common", "rollout", "router", "reward", "trainer"}
    assert {m.__name__.rsplit(".", 1)[-1].removesuffix("_pb2") for m in MODULES} == protos


def test_trajectory_carries_what_the_trainer_needs() -> None:
    """ARCHITECTURE.md's list of Trajectory contents, checked against the schema."""
    fields = set(pb.common_pb2.Trajectory.DESCRIPTOR.fields_by_name)
    needed = {
        "id", "job_id", "prompt_id", "group_id", "sample_index", "prompt_token_ids",
        "response_token_ids", "behaviour_logprobs", "loss_mask", "policy_versions", "reward",
        "reward_components", "finish_reason", "num_turns", "metadata",
    }  # fmt: skip
    assert needed <= fields


def test_services_expose_the_contracted_rpcs() -> None:
    def methods(module: object, service: str) -> set[str]:
        return set(module.DESCRIPTOR.services_by_name[service].methods_by_name)  # type: ignore[attr-defined]

    rollout = {
        "Generate",
        "GenerateStream",
        "GenerateBatch",
        "LoadWeights",
        "Abort",
        "AbortJob",
        "Pause",
        "Resume",
        "GetStatus",
    }
    assert methods(pb.rollout_pb2, "Rollout") == rollout
    router = {"Generate", "GenerateStream", "GenerateBatch", "ListEngines", "DrainEngine", "AbortJob"}
    assert router <= methods(pb.router_pb2, "Router")
    assert methods(pb.reward_pb2, "Reward") == {"Score", "ScoreBatch", "CheckVerifier"}
    assert methods(pb.reward_pb2, "Tools") == {"Execute", "ListTools"}
    assert methods(pb.trainer_pb2, "Trainer") == {"GetStatus", "SaveCheckpoint", "Stop"}
