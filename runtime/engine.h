/*
 * engine.h -- private: what a tkv_model holds. The session and the forward
 * pass live in engine.c.
 */
#ifndef TKV_ENGINE_H
#define TKV_ENGINE_H

#include "model.h"
#include "tokenizer.h"

struct tkv_model {
    tkv_gguf *gguf;          /* the mapping; weights point into it */
    struct tkv_llama llama;  /* validated hyperparameters and tensors */
    tkv_tokenizer *tok;
};

#endif
