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
