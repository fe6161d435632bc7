"""Prints protocol codec costs (not a test): python tests/protocol/bench_protocol.py

Decoding a Produce request carrying 1 MiB and encoding a 1 MiB Fetch response must cost
microseconds, i.e. not scale with the payload.
"""
from __future__ import annotations

import uuid
import timeit

import protocol
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.producer import ProduceRequest
from protocol import BatchView, build_batch, iter_batches, validate_batch


def best(fn, n: int = 200) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main() -> None:
    batch = build_batch([(None, b"x" * 1000)] * 1040)  # ~1 MiB
    part = ProduceRequest.TopicProduceData.PartitionProduceData
    for version in (3, 9, 11):
        req = ProduceRequest(version=version, transactional_id=None, acks=-1, timeout_ms=30000,
                             topic_data=[ProduceRequest.TopicProduceData(
                                 version=version, name="bench",
                                 partition_data=[part(version=version, index=0, records=batch)])])
        req.with_header(correlation_id=1, client_id="bench")
        frame = bytes(req.encode(header=True))
        us = best(lambda: protocol.parse_request(frame))
        print(f"parse Produce v{version} with {len(batch) >> 10} KiB records: {us:8.1f} us")
        generic = ProduceRequest[version]
        us = best(lambda: generic.decode(frame, header=True), 50)
        print(f"  (kafka-python generic decode for comparison: {us:8.1f} us)")
    view = next(iter_batches(batch))
    print(f"iter_batches + BatchView (header only): {best(lambda: BatchView(batch, 0)):8.2f} us")
    print(f"validate_batch CRC-32C over 1 MiB:      {best(lambda: validate_batch(view)):8.1f} us")
    fr = FetchResponse.FetchableTopicResponse
    for version in (4, 11, 12, 16):
        chunks = [memoryview(batch)]
        resp = FetchResponse(version=version, throttle_time_ms=0, error_code=0, session_id=0,
                             responses=[fr(version=version, topic="bench", topic_id=uuid.uuid4(), partitions=[
                                 fr.PartitionData(version=version, partition_index=0,
                                                  error_code=0, high_watermark=1,
                                                  last_stable_offset=1, log_start_offset=0,
                                                  aborted_transactions=None,
                                                  preferred_read_replica=-1, records=chunks)])])
        header = protocol.RequestHeader(1, version, 1)
        us = best(lambda: protocol.encode_response_buffers(header, resp))
        print(f"encode Fetch v{version} 1 MiB as buffers (zero-copy): {us:8.1f} us")
    from protocol.examples import sample_message

    for key, version in ((12, 4), (3, 12), (18, 3)):
        req = sample_message(protocol.request_class(key), version)
        req.with_header(correlation_id=1, client_id="bench")
        frame = bytes(req.encode(header=True))
        hdr, _ = protocol.parse_request(frame)
        rsp = sample_message(protocol.response_class(key), version)
        parse_us = best(lambda: protocol.parse_request(frame), 2000)
        enc_us = best(lambda: protocol.encode_response(hdr, rsp), 2000)
        print(f"small {protocol.api_name(key)} v{version}: parse {parse_us:6.2f} us, "
              f"encode response {enc_us:6.2f} us")
    resp.responses[0].partitions[0].records = batch
    us = best(lambda: resp.encode(version=16), 50)
    print(f"  (kafka-python generic encode of the same: {us:8.1f} us)")


if __name__ == "__main__":
    main()
