/* yesno: the answer is exactly one token, the first token of "Yes" or of "No"; then the sequence stops. */
#include "aici.h"

static uint32_t yes, no;
static int answered;

static void init_prompt(const uint32_t *prompt, uint32_t n) {
    uint32_t k;
    uint32_t *t = aici_tokenize("Yes", 3, &k);
    yes = t[0];
    free(t);
    t = aici_tokenize("No", 2, &k);
    no = t[0];
    free(t);
}

static aici_mid_result mid_process(const uint32_t *fork_group, uint32_t n) {
    if (answered) return aici_mid_stop();
    uint32_t *mask = aici_mask_new();
    aici_mask_allow(mask, yes);
    aici_mask_allow(mask, no);
    aici_return_mask(mask);
    free(mask);
    return aici_mid_sample();
}

static int post_process(const uint32_t *tokens, uint32_t n, uint32_t backtrack) {
    if (n) answered = 1;
    return answered;
}

static const aici_ctrl ctrl = {init_prompt, NULL, mid_process, post_process};
const aici_ctrl *aici_controller(void) { return &ctrl; }
