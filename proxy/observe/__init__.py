"""What operators watch the proxy with: Prometheus metrics (`metrics`) and OpenTelemetry
traces (`tracing`). Both read a finished request's Capture; neither changes what is
forwarded or recorded, and a failure of either never fails a request.
"""
