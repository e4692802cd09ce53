"""Object storage beyond segments: small objects with conditional writes (`conditional`)
and trained adapters through a bucket (`adapter_sync`)."""
