"""A group's samples kept as the engine's bytes, from the router's reply to the trajectories stream.

A step's samples are megabytes of per-token arrays, which the runner only passes on: parsing them
into numbers, copying them into Trajectories and serialising those again was half of its CPU.
A packed repeated field and a bytes field share the wire format (a key, a length, the payload),
so ``PackedGenerateBatchResponse`` reads a GenerateBatchResponse with each completion's arrays
left as their packed payloads, and a ``SplicedTrajectory`` is a Trajectory's other fields (a
message, ``head``) followed by those payloads as its own array fields' records (``tail``): its
bytes are the Trajectory's, and a consumer parses them as one.

A ``SplicedTrajectory`` reads and writes like a Trajectory for the runner's later stages (the
strategy's name, reward shapings, stage times): every field is the head's, and reading an array
field first parses the tail into the head, so that nothing ever reads a missing array.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.unknown_fields import UnknownFieldSet

from services.common.pb import common_pb2, reward_pb2, rollout_pb2
from services.common.wire import key, record, varint

Trajectory = common_pb2.Trajectory
ARRAYS = frozenset({"response_token_ids", "behaviour_logprobs", "policy_versions", "loss_mask"})
"""The Trajectory fields a SplicedTrajectory holds as packed bytes until one is read."""
_CONTINUATION_BYTES = bytes(range(0x80, 0x100))
"""A varint's bytes but its last have the high bit set."""
_FLOAT_BYTES = 4
_RESULT_KEY_BYTES = len(key(rollout_pb2.PackedGenerateBatchResponse.RESULTS_FIELD_NUMBER))


def varint_count(packed: bytes) -> int:
    """The numbers in a packed payload of varints: each ends in the one byte below 0x80."""
    return len(packed.translate(None, _CONTINUATION_BYTES))


def packed_batch(data: bytes) -> rollout_pb2.PackedGenerateBatchResponse:
    """``data``, a GenerateBatchResponse, read with its completions' arrays as packed bytes. A
    sender may encode an array unpacked or in several pieces (the format allows both; verst's
    own never do): then the arrays are parsed whole and packed again, so nothing is lost."""
    view = rollout_pb2.PackedGenerateBatchResponse.FromString(data)
    if _byte_size(view) == len(data) and not any(
        len(UnknownFieldSet(completion))
        for result in view.results
        for completion in result.response.completions
    ):
        return view
    full = rollout_pb2.GenerateBatchResponse.FromString(data)
    return rollout_pb2.PackedGenerateBatchResponse.FromString(full.SerializeToString())


def _byte_size(view: rollout_pb2.PackedGenerateBatchResponse) -> int:
    """``view.ByteSize()``, as its results' records: the same number without encoding the whole
    reply into one buffer (3.3 -> 0.35 ms a step's reply of 64 groups of 8 x 1,000 tokens)."""
    return sum(_RESULT_KEY_BYTES + len(varint(size)) + size for size in (r.ByteSize() for r in view.results))


def packed_response(response: rollout_pb2.GenerateResponse) -> rollout_pb2.PackedGenerateResponse:
    """A parsed response as a packed one (a router without GenerateBatch, a test's stub)."""
    return rollout_pb2.PackedGenerateResponse.FromString(response.SerializeToString())


def unpacked_response(packed: rollout_pb2.PackedGenerateResponse) -> rollout_pb2.GenerateResponse:
    """A packed response parsed whole, for callers that read the numbers."""
    return rollout_pb2.GenerateResponse.FromString(packed.SerializeToString())


def unpacked_completion(packed: rollout_pb2.PackedCompletion) -> rollout_pb2.Completion:
    return rollout_pb2.Completion.FromString(packed.SerializeToString())


def token_ids(packed: rollout_pb2.PackedCompletion) -> list[int]:
    """The completion's token ids as numbers (parsing nothing else)."""
    field = rollout_pb2.Completion.TOKEN_IDS_FIELD_NUMBER
    return list(rollout_pb2.Completion.FromString(record(field, packed.token_ids)).token_ids)


def merge_token_ids(request: reward_pb2.ScoreRequest, packed: rollout_pb2.PackedCompletion) -> None:
    """Set the request's response_token_ids to the completion's, from their packed bytes."""
    request.MergeFromString(record(reward_pb2.ScoreRequest.RESPONSE_TOKEN_IDS_FIELD_NUMBER, packed.token_ids))


def lengths(packed: rollout_pb2.PackedCompletion) -> tuple[int, int, int]:
    """Tokens, logprobs and policy versions of a packed completion (-1: logprobs not whole floats)."""
    logprobs, rest = divmod(len(packed.logprobs), _FLOAT_BYTES)
    return varint_count(packed.token_ids), logprobs if not rest else -1, varint_count(packed.policy_versions)


_TOKEN_IDS_KEY = key(Trajectory.RESPONSE_TOKEN_IDS_FIELD_NUMBER)
_LOGPROBS_KEY = key(Trajectory.BEHAVIOUR_LOGPROBS_FIELD_NUMBER)
_VERSIONS_KEY = key(Trajectory.POLICY_VERSIONS_FIELD_NUMBER)
_LOSS_MASK_KEY = key(Trajectory.LOSS_MASK_FIELD_NUMBER)


class SplicedTrajectory:
    """A Trajectory as ``head`` (every field but the arrays) and ``tail`` (the arrays' records,
    the loss mask all true: every token is the model's own)."""

    __slots__ = ("_head", "_lengths", "_tail")
    _lengths: tuple[int, int, int, int] | None
    """None once the tail is parsed into the head."""
    DESCRIPTOR = Trajectory.DESCRIPTOR

    def __init__(self, head: Trajectory, completion: rollout_pb2.PackedCompletion) -> None:
        """``completion``'s arrays align (``group.generate_packed`` checked them): its tokens are
        its logprobs' bytes over four, counted without reading a varint."""
        logprobs = completion.logprobs
        tokens = len(logprobs) // _FLOAT_BYTES
        tail = b""
        if tokens:  # the records joined in one copy: key, payload length, payload
            token_ids, versions = completion.token_ids, completion.policy_versions
            tail = b"".join((
                _TOKEN_IDS_KEY, varint(len(token_ids)), token_ids,
                _LOGPROBS_KEY, varint(len(logprobs)), logprobs,
                _VERSIONS_KEY, varint(len(versions)), versions,
                _LOSS_MASK_KEY, varint(tokens), b"\x01" * tokens,
            ))  # fmt: skip
        object.__setattr__(self, "_head", head)
        object.__setattr__(self, "_tail", tail)
        object.__setattr__(self, "_lengths", (tokens,) * 4)

    def __getattr__(self, name: str) -> Any:  # what the slots and the class lack: the head's
        if name in ARRAYS:
            self.message()
        return getattr(self._head, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._head, name, value)

    def message(self) -> Trajectory:
        """The whole Trajectory (its arrays parsed in, once)."""
        if self._lengths is not None:
            self._head.MergeFromString(self._tail)
            object.__setattr__(self, "_tail", b"")
            object.__setattr__(self, "_lengths", None)
        return self._head

    def array_lengths(self) -> tuple[int, int, int, int]:
        """Tokens, logprobs, policy versions and loss mask entries, without parsing them."""
        return self._lengths if self._lengths is not None else array_lengths(self._head)

    def SerializeToString(self) -> bytes:  # the protobuf method it stands for
        return self._head.SerializeToString() + self._tail


def head(trajectory: Trajectory | SplicedTrajectory) -> Trajectory:
    """The message that holds the trajectory's other fields than its arrays: reading those from
    it skips the SplicedTrajectory's attribute forwarding (a Python call each)."""
    return trajectory._head if isinstance(trajectory, SplicedTrajectory) else trajectory


def array_lengths(trajectory: Trajectory | SplicedTrajectory) -> tuple[int, int, int, int]:
    """Tokens, logprobs, policy versions and loss mask entries of either kind of trajectory."""
    if isinstance(trajectory, SplicedTrajectory):
        return trajectory.array_lengths()
    t = trajectory
    return len(t.response_token_ids), len(t.behaviour_logprobs), len(t.policy_versions), len(t.loss_mask)
