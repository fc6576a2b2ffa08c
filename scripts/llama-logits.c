/* llama-logits MODEL TOKENS LOGITS ACTIVATIONS [ADAPTER SCALE]...
 *
 * Runs llama.cpp on one sequence, TOKENS (comma-separated ids), with the LoRA adapters given
 * (each at its SCALE, as llama-cli's --lora-scaled), and writes
 *   LOGITS: the logits of every position, little-endian float32 [tokens, vocabulary];
 *   ACTIVATIONS: the float32 input of every ternary matmul, which llama.cpp quantises to Q8_K
 *     (attn_norm-i: q/k/v's, attn_sub_norm-i: o's, ffn_norm-i: gate/up's, ffn_sub_norm-i: down's),
 *     as records: the tensor's name (64 bytes, NUL-padded), int32 rows (tokens), int32 columns,
 *     then rows × columns float32.
 * The KV cache is F32 and flash attention off, so that llama.cpp's rounding stays that of its
 * matmuls (F16 caches would round K and V). Exit status 1 with a message on stderr for anything
 * llama.cpp refuses. Built by scripts/llama-cpp.sh; run by tests/integrations/test_llama_cpp.py. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static const char *SITES[] = {"attn_norm-", "attn_sub_norm-", "ffn_norm-", "ffn_sub_norm-"};
static bool dump_failed = false;

static int fail(const char *what, const char *detail) {
    fprintf(stderr, "llama-logits: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    return 1;
}

static bool is_site(const char *name) {  /* <site>-<layer> */
    for (size_t i = 0; i < sizeof(SITES) / sizeof(*SITES); i++) {
        size_t n = strlen(SITES[i]);
        if (!strncmp(name, SITES[i], n) && name[n] >= '0' && name[n] <= '9') return true;
    }
    return false;
}

static bool dump(struct ggml_tensor *t, bool ask, void *out) {
    if (ask || !is_site(t->name)) return is_site(t->name);
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || t->ne[2] != 1 || t->ne[3] != 1) {
        fprintf(stderr, "llama-logits: %s is not a contiguous float32 matrix\n", t->name);
        dump_failed = true;
        return false;
    }
    char name[64] = {0};
    strncpy(name, t->name, sizeof(name) - 1);
    int32_t shape[2] = {(int32_t) t->ne[1], (int32_t) t->ne[0]};
    size_t bytes = ggml_nbytes(t);
    float *data = malloc(bytes);
    ggml_backend_tensor_get(t, data, 0, bytes);
    bool written = fwrite(name, 1, sizeof(name), out) == sizeof(name) && fwrite(shape, sizeof(int32_t), 2, out) == 2 &&
                   fwrite(data, 1, bytes, out) == bytes;
    free(data);
    if (!written) dump_failed = true;
    return written;
}

int main(int argc, char **argv) {
    if (argc < 5 || (argc - 5) % 2)
        return fail("usage: llama-logits MODEL TOKENS LOGITS ACTIVATIONS [ADAPTER SCALE]...", NULL);
    int n_tokens = 1;
    for (const char *c = argv[2]; *c; c++) n_tokens += *c == ',';
    llama_token *tokens = malloc(sizeof(llama_token) * n_tokens);
    char *end = argv[2];
    for (int i = 0; i < n_tokens; i++) {
        tokens[i] = (llama_token) strtol(end, &end, 10);
        if (*end == ',') end++;
    }
    if (*end) return fail("TOKENS is not a comma-separated list of integers", argv[2]);

    llama_backend_init();
    struct llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return fail("llama.cpp could not load the model", argv[1]);

    int n_adapters = (argc - 5) / 2;
    struct llama_adapter_lora **adapters = malloc(sizeof(*adapters) * (n_adapters + 1));
    float *scales = malloc(sizeof(float) * (n_adapters + 1));
    for (int i = 0; i < n_adapters; i++) {
        adapters[i] = llama_adapter_lora_init(model, argv[5 + 2 * i]);
        if (!adapters[i]) return fail("llama.cpp could not load the adapter", argv[5 + 2 * i]);
        scales[i] = strtof(argv[6 + 2 * i], NULL);
    }

    FILE *activations = fopen(argv[4], "wb");
    if (!activations) return fail("cannot write", argv[4]);
    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_tokens;
    cparams.n_threads = cparams.n_threads_batch = 1;
    cparams.type_k = cparams.type_v = GGML_TYPE_F32;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.cb_eval = dump;
    cparams.cb_eval_user_data = activations;
    struct llama_context *ctx = llama_init_from_model(model, cparams);
    if (!ctx) return fail("llama.cpp could not make a context", NULL);
    if (n_adapters && llama_set_adapters_lora(ctx, adapters, n_adapters, scales))
        return fail("llama.cpp could not apply the adapters", NULL);

    struct llama_batch batch = llama_batch_init(n_tokens, 0, 1);
    for (int i = 0; i < n_tokens; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_tokens;
    if (llama_decode(ctx, batch) || dump_failed) return fail("llama_decode failed", NULL);
    if (fclose(activations)) return fail("cannot write", argv[4]);

    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *out = fopen(argv[3], "wb");
    if (!out) return fail("cannot write", argv[3]);
    for (int i = 0; i < n_tokens; i++) {
        const float *row = llama_get_logits_ith(ctx, i);
        if (!row || fwrite(row, sizeof(float), n_vocab, out) != (size_t) n_vocab) return fail("no logits", NULL);
    }
    if (fclose(out)) return fail("cannot write", argv[3]);

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
