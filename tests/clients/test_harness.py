"""The shared harness itself: the moto S3 fixture keeps its port across stop/start."""
import boto3


def test_s3_endpoint_restart_keeps_port(s3_endpoint):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="harness")
    s3.put_object(Bucket="harness", Key="k", Body=b"v")
    assert s3.get_object(Bucket="harness", Key="k")["Body"].read() == b"v"
    url = s3_endpoint.url
    s3_endpoint.stop()
    s3_endpoint.start()
    assert s3_endpoint.url == url
    s3.create_bucket(Bucket="harness2")
    assert "harness2" in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_broker_fixture_restarts_on_the_same_port(broker):
    """stop() (SIGTERM, clean exit) and kill() both leave a broker that start() brings back
    on the same address with the same data directory."""
    from datapath.wire import api_versions_roundtrip
    address = broker.bootstrap
    assert broker.running and api_versions_roundtrip(broker.host, broker.port)
    broker.stop()
    assert not broker.running and not api_versions_roundtrip(broker.host, broker.port)
    broker.start()
    assert broker.bootstrap == address and api_versions_roundtrip(broker.host, broker.port)
    broker.kill()
    assert not broker.running
    broker.start()
    assert broker.running and broker.data_dir.exists()
    assert broker.log_text().count("===== start") == 3
