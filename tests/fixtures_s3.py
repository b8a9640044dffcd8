"""S3 fixtures: a moto server on 127.0.0.1 (port 0), talked to over HTTP by the real boto3."""
