"""services/common/wire.py against what protobuf itself writes and reads."""

from __future__ import annotations

import pytest

from services.common.pb import rollout_pb2
from services.common.wire import record, records, varint

RESULTS = rollout_pb2.GenerateBatchResponse.RESULTS_FIELD_NUMBER


def result(size: int, code: int = 0) -> rollout_pb2.GenerateResult:
    return rollout_pb2.GenerateResult(code=code, details="x" * size)


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 128, 16_381, 16_384, 2_097_152, 3_000_000])
def test_a_record_is_what_protobuf_writes_and_reads_back(size: int) -> None:
    one = result(size)
    wire = record(RESULTS, one.SerializeToString())
    assert wire == rollout_pb2.GenerateBatchResponse(results=[one]).SerializeToString()
    assert [bytes(r) for r in records(wire, RESULTS)] == [wire]


def test_a_reply_splits_into_its_elements_records_and_they_join_into_another() -> None:
    elements = [result(size, code) for code, size in enumerate([0, 3, 200, 70_000, 1])]
    wire = rollout_pb2.GenerateBatchResponse(results=elements).SerializeToString()
    split = records(wire, RESULTS)
    assert len(split) == len(elements) and b"".join(split) == wire
    reordered = rollout_pb2.GenerateBatchResponse.FromString(b"".join([split[3], split[0]]))
    assert list(reordered.results) == [elements[3], elements[0]]
    assert records(b"", RESULTS) == []


def test_varints_are_protobufs() -> None:
    for value in (0, 1, 127, 128, 300, 2**21, 2**35 + 7, 2**63 - 1):
        message = rollout_pb2.GenerateResult(code=value % 2**31)
        assert message.SerializeToString() in (b"", b"\x10" + varint(value % 2**31))


@pytest.mark.parametrize(
    "data",
    [
        b"\x12\x00",  # field 2
        b"\x0a\x05abc",  # runs past the end
        b"\x0a",  # no length
        b"\x0a\xff",  # a varint cut short
        b"\x08\x01",  # field 1 as a varint, not a message
    ],
)
def test_anything_but_whole_records_of_the_field_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        records(data, RESULTS)
