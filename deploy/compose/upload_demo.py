"""Compose job: make the demo checkpoint and upload it to the S3 store (idempotent, then exit 0).

Runs in the weightstream image, which already has boto3, safetensors and torch. Settings come from
the environment that docker-compose.yml passes: DEMO_BUCKET, DEMO_MODEL, AWS_ENDPOINT_URL and the
AWS_* credentials.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError

from weightstream.samples import llama_like_state_dict, save_sharded

# Bounded: MinIO is already healthy when compose starts this job; the retries cover a slow first answer.
ATTEMPTS = 30


def main() -> int:
    bucket = os.environ.get("DEMO_BUCKET", "weights")
    model = os.environ.get("DEMO_MODEL", "demo-llama")
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], config=Config(s3={"addressing_style": "path"}))
    for attempt in range(ATTEMPTS):
        try:
            s3.head_bucket(Bucket=bucket)
            break
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                raise
            s3.create_bucket(Bucket=bucket)
            print(f"created bucket {bucket}")
            break
        except EndpointConnectionError:
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(1)
    with tempfile.TemporaryDirectory(prefix="weightstream-demo-") as tmp:
        folder = Path(tmp) / model
        save_sharded(llama_like_state_dict(), folder, shards=3)
        for path in sorted(folder.iterdir()):
            key = f"{model}/{path.name}"
            s3.upload_file(str(path), bucket, key)
            print(f"uploaded s3://{bucket}/{key} ({path.stat().st_size:,d} bytes)")
    print(f"demo checkpoint ready: s3://{bucket}/{model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
