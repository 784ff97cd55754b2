"""Generated from protos/ by `python -m pdmesh.protogen`: do not edit."""
