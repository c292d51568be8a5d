"""Pipeline (SWARM) parallelism: routing hops to stage replicas and placing peers on stages."""
