"""Memory-limited batch generation jobs: many prompts, one device, a byte budget."""

from alisa.jobs.io import OutputLog, Request, read_requests
from alisa.jobs.runner import BatchJob, JobSummary, run_batch
from alisa.jobs.sizing import BatchMemory, batch_memory, largest_batch

__all__ = [
    "BatchJob",
    "BatchMemory",
    "JobSummary",
    "OutputLog",
    "Request",
    "batch_memory",
    "largest_batch",
    "read_requests",
    "run_batch",
]
