"""gRPC plumbing shared by every service: servers, channels, safe calls, contained handlers."""
