"""Ray jobs: the one start-or-join policy, job submission, image inputs and the extraction job."""
