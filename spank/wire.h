/*
 * The wire between the plugin and the Python side: agent/core/wire.py describes every
 * message; these are its constants, name for name (tests/unit check them against
 * wire.C_CONSTANTS).  Every value goes as --name=VALUE: the values are the job's,
 * and one starting with '-' must stay a value.
 */
#ifndef TFIMAGE_WIRE_H
#define TFIMAGE_WIRE_H

#define TFI_WIRE_MAGIC "TFI1" /* sent with its NUL */
/* Seconds a caller waits beyond the config's hook_deadline for the helper or a
 * hook to say it gave up. */
#define TFI_HOOK_GRACE 30
/* The pin server's "busy" (EX_TEMPFAIL): its slots are taken; ask again shortly. */
#define TFI_PIN_BUSY 75
/* The most stdout taken in one answer (step-prepare's tokens). */
#define TFI_MAX_ANSWER 1048576

/* The job's control environment (spank_job_control_setenv), and the name its
 * steps see it by (an srun inside a job inherits the image from it). */
#define TFI_CONTROL_IMAGE "TFIMAGE_IMAGE"
#define TFI_STEP_IMAGE_VAR "SLURM_SPANK_TFIMAGE_IMAGE"

/* plugstack.conf's defaults (the config's own default path and hook_deadline) */
#define TFI_DEFAULT_CONFIG "/etc/tfimage/config.yaml"
#define TFI_DEFAULT_HELPER "/opt/tfimage/bin/tfimage"
#define TFI_DEFAULT_SUBMIT_TIMEOUT 30
#define TFI_DEFAULT_HOOK_DEADLINE 600

/* The admin's kill switch: this file beside the config refuses new --tf-image
 * submissions; jobs already queued or running, and their inner sruns, go on. */
#define TFI_OFF_SWITCH "submit.off"

#define TFI_CMD_STEP_PREPARE "step-prepare"
#define TFI_CMD_SUBMIT_CHECK "submit-check"

/* step-prepare's answer tokens */
#define TFI_TOK_ARGV "argv"
#define TFI_TOK_SRC "src"
#define TFI_TOK_ENV "env"

/* step-prepare's flags (always: job, step, uid, image, node-id, local-tasks) */
#define TFI_ARG_JOB "--job="
#define TFI_ARG_STEP "--step="
#define TFI_ARG_UID "--uid="
#define TFI_ARG_IMAGE "--image="
#define TFI_ARG_NODE_ID "--node-id="
#define TFI_ARG_LOCAL_TASKS "--local-tasks="
#define TFI_ARG_WORKDIR "--workdir="
#define TFI_ARG_SCRIPT "--script="
#define TFI_ARG_TF_MOUNT "--tf-mount="
#define TFI_ARG_GPUS "--gpus"
#define TFI_ARG_ARRAY_JOB "--array-job="
#define TFI_ARG_ARRAY_TASK "--array-task="
#define TFI_ARG_LAYOUT "--layout="
/* submit-check's (and --tf-mount= above) */
#define TFI_ARG_JOB_IMAGE "--job-image="

/* the step variables passed with --layout= */
#define TFI_LAYOUT_0 "SLURM_JOB_ID"
#define TFI_LAYOUT_1 "SLURM_STEP_ID"
#define TFI_LAYOUT_2 "SLURM_STEP_NODELIST"
#define TFI_LAYOUT_3 "SLURM_STEP_TASKS_PER_NODE"
#define TFI_LAYOUT_4 "SLURM_STEP_RESV_PORTS"
#define TFI_LAYOUT_5 "SLURM_STEP_GPUS"
#define TFI_LAYOUT_6 "CUDA_VISIBLE_DEVICES"
#define TFI_LAYOUT_7 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
#define TFI_LAYOUT_8 "SLURM_MEM_PER_GPU"
#define TFI_LAYOUTS { TFI_LAYOUT_0, TFI_LAYOUT_1, TFI_LAYOUT_2, TFI_LAYOUT_3, TFI_LAYOUT_4, \
		      TFI_LAYOUT_5, TFI_LAYOUT_6, TFI_LAYOUT_7, TFI_LAYOUT_8, NULL }

#endif
