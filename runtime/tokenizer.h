/*
 * tokenizer.h -- GPT-2 style byte-level BPE, built from a GGUF vocabulary.
 *
 * Supported: tokenizer.ggml.model = "gpt2" with the pre-tokenizers "smollm",
 * "llama-bpe" (Llama 3) and "qwen2", special (control) tokens, and a fixed
 * ChatML formatter. Other tokenizer models (e.g. SentencePiece "llama") fail
 * with TKV_ERR_UNSUPPORTED and a message naming them. Algorithm and edge
 * cases: shared spec eval_gguf_tokenizer.md section 3, docs/tokenizer.md.
 */
#ifndef TKV_TOKENIZER_H
#define TKV_TOKENIZER_H

#include "gguf.h"

typedef struct tkv_tokenizer tkv_tokenizer;

/* Reads tokenizer.ggml.* from g; copies what it keeps (g may be closed after).
 * tokenizer.ggml.model must be "gpt2" (else TKV_ERR_UNSUPPORTED), with a
 * supported tokenizer.ggml.pre (absent means llama.cpp's "default"). BOS is
 * prepended only when the caller passes TKV_TOK_ADD_BOS *and* the model asks
 * for it (tokenizer.ggml.add_bos_token; when absent, true for llama-bpe and
 * false otherwise, like llama.cpp): SmolLM2 never gets a BOS. */
tkv_status tkv_tokenizer_init(const tkv_gguf *g, tkv_tokenizer **out);
void       tkv_tokenizer_free(tkv_tokenizer *t);

uint32_t  tkv_tokenizer_n_vocab(const tkv_tokenizer *t);
tkv_token tkv_tokenizer_bos(const tkv_tokenizer *t);   /* -1 if none */
tkv_token tkv_tokenizer_eos(const tkv_tokenizer *t);   /* -1 if none */
bool      tkv_tokenizer_is_eog(const tkv_tokenizer *t, tkv_token tok);
bool      tkv_tokenizer_is_control(const tkv_tokenizer *t, tkv_token tok);

/* Same contracts as tkv_tokenize / tkv_detokenize / tkv_chat_prompt in
 * tierkv.h (which forward here). Thread-safe on a shared tokenizer. */
tkv_status tkv_tokenizer_encode(const tkv_tokenizer *t, const char *text, size_t len, unsigned flags,
                                tkv_token *out, size_t cap, size_t *n_out);
tkv_status tkv_tokenizer_decode(const tkv_tokenizer *t, const tkv_token *toks, size_t n, unsigned flags,
                                char *buf, size_t cap, size_t *len_out);
tkv_status tkv_tokenizer_chat(const tkv_tokenizer *t, const char *system, const char *user,
                              char *buf, size_t cap, size_t *len_out);

/* ---- internal, for tests (not part of the API) --------------------------- */

/* Splits text with the named pre-tokenizer ("smollm", "llama-bpe", "qwen2",
 * "gpt2", "default") and writes the byte length of each piece (in the input;
 * an invalid UTF-8 byte is a piece character of its own) to lens. Same size
 * contract as encode: *n_out pieces, TKV_ERR_TOO_SMALL when cap is short. */
tkv_status tkv_tokenizer_pretokenize_(const char *pre, const char *text, size_t len, size_t *lens, size_t cap,
                                      size_t *n_out);
/* GPT-2 bytes_to_unicode and its inverse (-1 for code points outside it). */
uint32_t tkv_tokenizer_byte_to_cp_(uint8_t b);
int      tkv_tokenizer_cp_to_byte_(uint32_t cp);

#endif /* TKV_TOKENIZER_H */
