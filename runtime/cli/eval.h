/*
 * eval.h -- `tierkv eval`: RULER-style tasks scored for each KV policy and
 * budget against the dense `full` reference (docs/eval.md).
 */
#ifndef TKV_CLI_EVAL_H
#define TKV_CLI_EVAL_H

/* argv[1] is "eval"; returns the exit status (0 ok, 1 runtime failure,
 * 2 bad usage). */
int cmd_eval(int argc, char **argv);

#endif
