"""The fleet's pods: discovery from EndpointSlices, readiness and load per engine, and the fleet-wide reset
through the fan-out."""
